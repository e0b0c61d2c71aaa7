"""Child body for the SIGKILL crash test: save checkpoint after checkpoint until killed.

Imports only torch and the checkpoint module (no transformers): the parent forks it, so the
child starts in milliseconds. Save number `i` holds weights filled by `fill_value(i)` and an
optimizer whose state was built by `i + 1` steps, so the parent can tell which save it loaded.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch
from torch import nn

from policyworker.shell import checkpoint
from policyworker.shell.checkpoint import commit
from policyworker.shell.parallel.context import ParallelContext


class SimpleWorker:
    """The attributes `policyworker.shell.checkpoint` reads from a worker, around a plain module."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.tokenizer = None
        self.cfg = None
        self.parallel = ParallelContext.single(torch.device("cpu"))
        self._reference_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.saver = checkpoint.AsyncSaver()

    @property
    def reference_state(self) -> dict | None:  # the name CheckpointOwner reads
        return self._reference_state


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))  # 1 MiB of fp32 weights


def fill_value(i: int) -> float:
    return float(i + 1)


def set_weights(model: nn.Module, i: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill_value(i))


def pause_after_renames(
    pause_s: float = 0.0, stop_after: int | None = None, stop_marker: str | None = None
) -> None:
    """Test hook: wrap the commit's per-folder rename step in this (forked) process.

    Sleeps `pause_s` after every folder step (`_put_in_place`), so that random kills often
    land between two renames; after the `stop_after`-th step it touches `stop_marker` and waits
    for the parent's SIGKILL (exiting after 60 s if none comes).
    """
    original = commit._put_in_place
    count = 0

    def wrapped(*args: object) -> None:
        nonlocal count
        original(*args)
        count += 1
        if stop_after is not None and count == stop_after:
            assert stop_marker is not None
            pathlib.Path(stop_marker).touch()
            time.sleep(60)
            os._exit(1)
        time.sleep(pause_s)

    commit._put_in_place = wrapped


def run(
    root: str,
    marker: str,
    pause_s: float = 0.0,
    stop_in_save: int | None = None,
    stop_marker: str | None = None,
) -> None:
    """Save to root/weights + root/optimizer forever; touch `marker` after the first save.

    `pause_s`: sleep after each folder rename. `stop_in_save=i`: in save `i`, stop after its
    first folder rename (see `pause_after_renames`).
    """
    torch.set_num_threads(1)
    pause_after_renames(pause_s)
    worker = SimpleWorker(build_model())
    root_path = pathlib.Path(root)
    i = 0
    while True:
        set_weights(worker.model, i)
        worker.model(torch.ones(1, 256)).sum().backward()
        worker.optimizer.step()
        worker.optimizer.zero_grad()
        worker.scheduler.step()
        set_weights(worker.model, i)
        if i == stop_in_save:
            pause_after_renames(stop_after=1, stop_marker=stop_marker)
        checkpoint.save_checkpoint(
            worker, root_path / "weights", root_path / "optimizer", is_final_checkpoint=i % 2 == 0
        )
        checkpoint.finalize_async_save(worker)
        if i == 0:
            pathlib.Path(marker).touch()
        i += 1


def load_until_first_rename(root: str, stop_marker: str) -> None:
    """Load root's checkpoint; its recovery stops after its first rename (killed there).

    The commit was stopped after the weights folder: the recovery's first folder step finds it
    in place, its second renames the optimizer folder.
    """
    torch.set_num_threads(1)
    pause_after_renames(stop_after=2, stop_marker=stop_marker)
    worker = SimpleWorker(build_model(seed=1))
    checkpoint.load_checkpoint(
        worker, pathlib.Path(root) / "weights", pathlib.Path(root) / "optimizer"
    )


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
    os._exit(0)

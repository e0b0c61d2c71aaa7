"""Child bodies for the checkpoint fault tests (forked: module-level, no transformers)."""

from __future__ import annotations

import os
import pathlib
import signal
import time
import traceback

import torch

from policyworker.shell import checkpoint
from policyworker.shell.checkpoint import saver as saver_module
from tests.shell.checkpoint.checkpoint_crash_child import SimpleWorker, build_model, set_weights


def save_loop(root: str, go: str, result: str, saves: int) -> None:
    """Wait for `go`, then save `saves` times under `root`; write 'ok' or the traceback."""
    torch.set_num_threads(1)
    worker = SimpleWorker(build_model())
    worker.model(torch.ones(1, 256)).sum().backward()
    worker.optimizer.step()
    deadline = time.monotonic() + 60
    while not pathlib.Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    outcome = "ok"
    try:
        for i in range(saves):
            set_weights(worker.model, i)
            checkpoint.save_checkpoint(
                worker,
                pathlib.Path(root) / "weights",
                pathlib.Path(root) / "optimizer",
                is_final_checkpoint=i % 2 == 1,
            )
            checkpoint.finalize_async_save(worker)
    except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
        outcome = traceback.format_exc()
    pathlib.Path(result).write_text(outcome)
    os._exit(0)


def interrupted_async_save(root: str) -> None:
    """Start an async save whose writes take 2 s, then get Ctrl-C (SIGINT) before finalizing;
    the interpreter exits through its normal shutdown (atexit hooks run)."""
    torch.set_num_threads(1)
    run_jobs = saver_module.run_jobs_concurrently

    def slow(jobs):
        time.sleep(2.0)
        run_jobs(jobs)

    saver_module.run_jobs_concurrently = slow
    worker = SimpleWorker(build_model())
    checkpoint.save_checkpoint(
        worker, pathlib.Path(root) / "weights", pathlib.Path(root) / "optimizer"
    )
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # the KeyboardInterrupt lands here

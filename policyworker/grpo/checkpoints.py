"""Checkpoint cadence of a run: `checkpoint_dir/step_<k>/{weights,optimizer,grpo_state.json}`.

The worker writes weights, reference, optimizer, scheduler and RNG asynchronously
(`PolicyWorker.save_checkpoint`) while the next step runs; a step counts as committed only once
that save is finalised (after the next step, or at the end) and `grpo_state.json` (the step, the
ranking metric, the metrics so far) is renamed into place after it. Resume picks the highest
committed step; a folder without the state file is a save that did not finish and is removed
before its step is saved again. After each commit the keep-top-k rule
(`functional.grpo.checkpoints_to_remove`) deletes the folders that lost.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

from policyworker.functional.grpo import checkpoints_to_remove
from policyworker.grpo.config import CheckpointingSection

__all__ = ["STATE_FILE", "Checkpointer", "committed_steps", "latest_committed"]

STATE_FILE = "grpo_state.json"


def _step_of(folder: pathlib.Path) -> int | None:
    name = folder.name
    if folder.is_dir() and name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def committed_steps(root: pathlib.Path) -> dict[int, dict[str, Any]]:
    """{step: its grpo_state.json} of every committed checkpoint under `root`."""
    found = {}
    if root.is_dir():
        for folder in root.iterdir():
            step = _step_of(folder)
            if step is not None and (folder / STATE_FILE).is_file():
                found[step] = json.loads((folder / STATE_FILE).read_text())
    return found


def latest_committed(root: pathlib.Path) -> tuple[int, pathlib.Path, dict[str, Any]] | None:
    """(step, folder, state) of the newest committed checkpoint, or None."""
    found = committed_steps(root)
    if not found:
        return None
    step = max(found)
    return step, root / f"step_{step}", found[step]


class Checkpointer:
    """Saves on the cadence of `section` through `worker`; one save in flight at a time."""

    def __init__(self, section: CheckpointingSection, worker: Any) -> None:
        self.section = section
        self.worker = worker
        self.root = pathlib.Path(section.checkpoint_dir)
        self._pending: tuple[int, dict[str, Any]] | None = None

    def due(self, step: int, *, last_step: int) -> bool:
        return self.section.enabled and (step % self.section.save_period == 0 or step == last_step)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start the async save of `step` (the previous one is committed first)."""
        self.commit()
        folder = self.root / f"step_{step}"
        if folder.exists():  # an unfinished save of this step from a run that was killed
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        self.worker.save_checkpoint(str(folder / "weights"), str(folder / "optimizer"))
        self._pending = (step, state)

    def commit(self) -> None:
        """Finalise the save in flight, write its state file, drop the checkpoints that lost."""
        if self._pending is None:
            return
        step, state = self._pending
        self.worker.finalize_async_save()
        folder = self.root / f"step_{step}"
        tmp = folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, folder / STATE_FILE)
        self._pending = None
        key = self.section.metric_name.removeprefix("train:")
        saved = [
            (s, st.get("metrics", {}).get(key)) for s, st in committed_steps(self.root).items()
        ]
        for gone in checkpoints_to_remove(
            saved,
            keep_top_k=self.section.keep_top_k,
            higher_is_better=self.section.higher_is_better,
        ):
            shutil.rmtree(self.root / f"step_{gone}", ignore_errors=True)

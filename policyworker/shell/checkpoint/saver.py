"""AsyncSaver: the pending writes of one worker's save, a background thread, and the folders
that `finalize` commits once every rank's writes landed."""

from __future__ import annotations

import atexit
import logging
import pathlib
import shutil
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from policyworker.shell.checkpoint.commit import _all_ranks_max, _commit, _on_rank0

__all__ = ["AsyncSaver", "FINALIZE_TIMEOUT_S"]

FINALIZE_TIMEOUT_S = 3600.0
log = logging.getLogger(__name__)


def _warn_at_exit(saver_ref: weakref.ReferenceType[AsyncSaver]) -> None:
    saver = saver_ref()
    if saver is not None:
        saver.warn_if_pending()


# ------------------------------------------------------------------------------ async saver


class AsyncSaver:
    """Pending writes of one worker: a background thread and the folders it will commit."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._commits: list[tuple[pathlib.Path, pathlib.Path]] = []
        self.group: Any = None  # gloo group for DCP's collectives off the main thread
        self.last_reference: tuple[pathlib.Path, tuple[Any, ...]] | None = None
        self._exit_hook = False

    @property
    def pending(self) -> bool:
        return bool(self._commits)

    def warn_if_pending(self) -> None:
        """At interpreter exit: a staged save that nobody finalized is not a checkpoint yet.

        Committing here is not safe under a process group (other ranks may be gone), so the
        exit only says which folders were left staged and how to avoid it."""
        if self._commits:
            staged = ", ".join(str(tmp) for tmp, _ in self._commits)
            log.warning(
                "exiting with an asynchronous checkpoint save that was never finalized; its "
                "staged folders (%s) are not a checkpoint. Call worker.finalize_async_save() or "
                "worker.shutdown() before exit, or save with is_final_checkpoint=True",
                staged,
            )

    def start(
        self,
        jobs: Sequence[Callable[[], None]],
        commits: Sequence[tuple[pathlib.Path, pathlib.Path]],
        *,
        background: bool,
    ) -> None:
        self._commits = list(commits)
        self._error = None
        if not self._exit_hook:
            atexit.register(_warn_at_exit, weakref.ref(self))
            self._exit_hook = True

        def run() -> None:
            try:
                for job in jobs:
                    job()
            except BaseException as exc:  # re-raised by finalize on the caller's thread
                self._error = exc

        if background:
            self._thread = threading.Thread(
                target=run, name="policyworker-checkpoint", daemon=False
            )
            self._thread.start()
        else:
            run()

    def finalize(self, parallel: Any, *, timeout_s: float = FINALIZE_TIMEOUT_S) -> None:
        """Wait for the writes, agree over all ranks that they landed, then rank 0 renames."""
        if not self._commits:
            return
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                msg = (
                    f"checkpoint writes did not finish within {timeout_s} s;"
                    " the disk is stalled or too slow"
                )
                raise TimeoutError(msg)
        self._thread = None
        error, commits, self._commits = self._error, self._commits, []
        failed = _all_ranks_max(parallel, int(error is not None))
        if failed:
            if parallel.rank == 0:
                for tmp, _ in commits:
                    shutil.rmtree(tmp, ignore_errors=True)
            if error is not None:
                raise error
            msg = "checkpoint writes failed on another rank; nothing was renamed into place"
            raise RuntimeError(msg)
        _on_rank0(parallel, "commit the checkpoint folders", lambda: _commit(commits))


def _checkpoint_group(saver: AsyncSaver) -> Any:
    """A gloo group for DCP (None in a single process): its collectives may run off-thread."""
    if not dist.is_initialized():
        return None
    if saver.group is None:
        saver.group = dist.new_group(backend="gloo")
    return saver.group

"""AsyncSaver: the pending writes of one worker's save, a background thread, the folders that
`finalize` commits once every rank's writes landed, and the CPU staging buffers
(`StagingBuffers`) that asynchronous saves reuse.

Staging buffers: an async save copies this rank's weight pieces and optimizer state into one
flat CPU buffer per group ("weights", "optimizer"), page-locked with `cudaHostRegister` when CUDA
exists, so the copy runs at pinned device-to-host bandwidth with no page faults. The buffers are
kept and reused by the next async save while the staged tensors keep their names, shapes and
dtypes (a group is reallocated when they change). Memory cost: pinned host memory equal to the
bytes this rank stages (its fp32 weight shards plus its optimizer state; about 18.5 GB for a
1.5B model with AdamW on one GPU), held from the first async save until `release_staging`
(`PolicyWorker.shutdown` calls it). A sync save (`is_final_checkpoint=True`) stages into these
buffers only when an async save already made them (the final save of a loop that saved
asynchronously: a copy at pinned bandwidth, then writes from host memory, is a little faster
than the path below). Otherwise it keeps nothing and stages nothing: its writes end inside the
call, so CPU state is written where it is and device state is copied out by the writer threads
while they write, overlapping the disk, through a small page-locked bounce buffer per writer
thread (`bounce`; freed when the writes end): the weights chunk by chunk (`safetensors_io`), the
optimizer one tensor at a time as DCP's writer threads ask for it (`dcp._BouncedSavePlanner`).
The folders of one save (weights, reference, optimizer, extra folders) are written side by side,
one job thread each (`run_jobs_concurrently`), in both kinds of save.

The copies are complete when `save_checkpoint` returns (`StagingBuffers.wait`): the next
optimizer step may overwrite the weights at once, from any stream or thread, so a CUDA event
handed to the training loop would have to be waited on by every path that mutates parameters
(train, draft co-training, load, refit receivers); at pinned bandwidth the blocking copy is
short enough that the simpler guarantee wins.
"""

from __future__ import annotations

import atexit
import logging
import pathlib
import shutil
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from policyworker.shell.checkpoint.claims import claim_folder, release_claim
from policyworker.shell.checkpoint.commit import _all_ranks_max, _commit, _on_rank0
from policyworker.shell.checkpoint.layout import CheckpointError

__all__ = [
    "AsyncSaver",
    "FINALIZE_TIMEOUT_S",
    "StagingBuffers",
    "on_threads",
    "run_jobs_concurrently",
]

FINALIZE_TIMEOUT_S = 3600.0
_ALIGN = 64  # bytes: every staged tensor starts at a multiple (any dtype's alignment)
log = logging.getLogger(__name__)
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


# ------------------------------------------------------------------------------ staging buffers


@attrs.define(eq=False)
class _Arena:
    """One group's flat CPU buffer and the tensor views staged into it."""

    layout: tuple[tuple[Hashable, tuple[int, ...], torch.dtype], ...]
    flat: torch.Tensor  # uint8
    views: list[torch.Tensor]
    unpin: weakref.finalize | None  # set when page-locked: unregisters (once; also at collection)

    @property
    def registered(self) -> bool:
        return self.unpin is not None


def _unregister(data_ptr: int) -> None:
    cudart: Any = torch.cuda.cudart()
    cudart.cudaHostUnregister(data_ptr)


def _register(flat: torch.Tensor) -> weakref.finalize | None:
    """Page-lock `flat` in place (exact size; torch's pinned allocator rounds up to a power of
    two); returns its unregister finalizer. None when CUDA is absent or the driver refuses (the
    buffer stays pageable)."""
    if flat.numel() == 0 or not torch.cuda.is_available():
        return None
    portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
    cudart: Any = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(flat.data_ptr(), flat.numel(), portable))
    if code != 0:
        log.warning(
            "cudaHostRegister of %d checkpoint staging bytes failed (cudaError %d); staging "
            "into pageable memory (slower device-to-host copies)",
            flat.numel(),
            code,
        )
        return None
    return weakref.finalize(flat, _unregister, flat.data_ptr())


class StagingBuffers:
    """CPU buffers an async save copies into, reused across saves (see the module docstring)."""

    def __init__(self) -> None:
        self._arenas: dict[str, _Arena] = {}
        self._devices: set[torch.device] = set()  # CUDA devices with copies in flight

    @property
    def nbytes(self) -> int:
        """Bytes held (pinned when CUDA exists)."""
        return sum(a.flat.numel() for a in self._arenas.values())

    def views(self, group: str) -> list[torch.Tensor]:
        """The staged tensors of `group` (empty if it has none)."""
        arena = self._arenas.get(group)
        return list(arena.views) if arena is not None else []

    def stage(
        self, group: str, items: Sequence[tuple[Hashable, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Copy each (key, tensor) into `group`'s buffer; return the contiguous CPU copies.

        Device copies are asynchronous; call `wait` before anything reads the copies or
        changes the sources.
        """
        layout = tuple((key, tuple(t.shape), t.dtype) for key, t in items)
        arena = self._arenas.get(group)
        if arena is None or arena.layout != layout:
            self._drop(group)
            arena = self._arenas[group] = _allocate(layout)
        for view, (_, src) in zip(arena.views, items, strict=True):
            asynchronous = arena.registered and src.device.type == "cuda"
            view.copy_(src.detach(), non_blocking=asynchronous)
            if asynchronous:
                self._devices.add(src.device)
        return list(arena.views)

    def wait(self) -> None:
        """Block until every copy `stage` queued has landed."""
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()
        self._devices.clear()

    def release(self) -> None:
        """Free every buffer (unpinning it first)."""
        self.wait()
        for group in list(self._arenas):
            self._drop(group)

    def _drop(self, group: str) -> None:
        arena = self._arenas.pop(group, None)
        if arena is not None and arena.unpin is not None:
            arena.unpin()  # before the memory goes back to the allocator


def _allocate(layout: tuple[tuple[Hashable, tuple[int, ...], torch.dtype], ...]) -> _Arena:
    offsets, total = [], 0
    for _, shape, dtype in layout:
        offsets.append(total)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        total += -(-nbytes // _ALIGN) * _ALIGN
    flat = torch.empty(total, dtype=torch.uint8)
    views = [
        flat[offset : offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
        for offset, (_, shape, dtype) in zip(offsets, layout, strict=True)
    ]
    return _Arena(layout=layout, flat=flat, views=views, unpin=_register(flat))


def _warn_at_exit(saver_ref: weakref.ReferenceType[AsyncSaver]) -> None:
    saver = saver_ref()
    if saver is not None:
        saver.warn_if_pending()


# ------------------------------------------------------------------------------ threads


def on_threads(
    fn: Callable[[_Item], _Result], items: Sequence[_Item], *, threads: int, name: str
) -> list[_Result]:
    """`fn` over `items` on up to `threads` threads (inline when that is one), results in
    order; once every call has ended, the first failure in item order is raised."""
    threads = min(threads, len(items))
    if threads < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, item) for item in items]
    return [future.result() for future in futures]


def run_jobs_concurrently(jobs: Sequence[Callable[[], None]]) -> None:
    """Run the write jobs of one save side by side, one thread each; raise the first failure
    (in job order) once all of them have ended.

    Each job writes its own folder, and one alone does not keep the disk busy (the weights'
    writer threads copy device pieces out between writes; DCP serializes the optimizer), so
    the folders overlap instead of queueing. Only the optimizer's DCP job talks to the process
    group, so no two jobs run collectives at the same time.
    """
    on_threads(lambda job: job(), jobs, threads=len(jobs), name="checkpoint-job")


# ------------------------------------------------------------------------------ async saver


class AsyncSaver:
    """Pending writes of one worker: a background thread and the folders it will commit."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._commits: list[tuple[pathlib.Path, pathlib.Path]] = []
        self.group: Any = None  # gloo group for DCP's collectives off the main thread
        self.last_reference: tuple[pathlib.Path, tuple[Any, ...], int | None] | None = None
        self.staging = StagingBuffers()  # reused by async saves; freed by release_staging
        self._claims: dict[pathlib.Path, int] = {}  # staged folder -> descriptor of its claim
        self._exit_hook = False

    @property
    def pending(self) -> bool:
        return bool(self._commits)

    def release_staging(self) -> None:
        """Free the staging buffers (after the pending writes that read them have finished)."""
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
        self.staging.release()

    def claim(self, tmps: Sequence[pathlib.Path]) -> None:
        """Create and claim the staged folders of a save (rank 0, under the parents' lock)."""
        try:
            for tmp in tmps:
                self._claims[tmp] = claim_folder(tmp)
        except BaseException:  # none of this save's folders stays behind
            self.discard_staged()
            raise

    def discard_staged(self) -> list[pathlib.Path]:
        """Remove the staged folders this process claimed and drop the claims; returns them."""
        removed = sorted(self._claims)
        for tmp, fd in sorted(self._claims.items()):
            shutil.rmtree(tmp, ignore_errors=True)
            release_claim(tmp, fd)
        self._claims.clear()
        return removed

    def _release_claims(self) -> None:
        for tmp, fd in sorted(self._claims.items()):
            release_claim(tmp, fd)
        self._claims.clear()

    def warn_if_pending(self) -> None:
        """At interpreter exit (after Ctrl-C, or a script that never finalized its last save):
        a staged save that nobody finalized is not a checkpoint, and it is removed.

        Committing here is not safe under a process group (other ranks may be gone), so the
        process that staged the folders (rank 0) deletes them and says so; another rank names
        what is left and how to remove it. The last committed checkpoint is unchanged."""
        if not self._commits and not self._claims:
            return
        staged = sorted({tmp for tmp, _ in self._commits} | set(self._claims))
        self._commits = []
        removed = self.discard_staged()
        left = [tmp for tmp in staged if tmp not in removed and tmp.exists()]
        if removed:
            log.warning(
                "exiting with an asynchronous checkpoint save that was never finalized; its "
                "staged folders were removed (not a checkpoint): %s. The last finalized "
                "checkpoint in those folders is unchanged. To keep the last save of a run, save "
                "it with is_final_checkpoint=True or end the run with worker.shutdown()",
                ", ".join(map(str, removed)),
            )
        if left:
            log.warning(
                "exiting with an asynchronous checkpoint save that was never finalized; its "
                "staged folders are not a checkpoint and are left on disk: %s. The next save "
                "into the same folders removes them, or remove them now with: rm -rf %s",
                ", ".join(map(str, left)),
                " ".join(f"'{tmp}'" for tmp in left),
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
                run_jobs_concurrently(jobs)
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
                self._release_claims()
            if isinstance(error, CheckpointException):  # a BaseException: `except Exception`
                msg = (  # would miss it
                    f"the checkpoint save into {[str(tmp) for tmp, _ in commits]} failed in "
                    f"torch.distributed.checkpoint ({type(error).__name__}: {error}); nothing "
                    f"was renamed into place, the last finalized checkpoint is unchanged"
                )
                raise CheckpointError(msg) from error
            if error is not None:
                raise error
            msg = "checkpoint writes failed on another rank; nothing was renamed into place"
            raise RuntimeError(msg)
        _on_rank0(parallel, "commit the checkpoint folders", lambda: _commit(commits))
        self._release_claims()


def _checkpoint_group(saver: AsyncSaver) -> Any:
    """A gloo group for DCP (None in a single process): its collectives may run off-thread."""
    if not dist.is_initialized():
        return None
    if saver.group is None:
        saver.group = dist.new_group(backend="gloo")
    return saver.group

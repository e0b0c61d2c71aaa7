"""Staging buffers of a colocated refit, and the grouped copies in and out of them.

The sender casts each bucket into one half of a ping-pong pair of staging buffers while the
receiver reads the other: ``ShmStaging`` (a 0600 file in ``SHM_DIR`` mapped shared, CPU) or
``CudaStaging`` (a CUDA tensor shared by its IPC handle, with interprocess events saying when a
half is filled and when it was consumed). Both expose the same methods, so the protocol code in
``zmq_sender`` and ``refit_server`` does not care which one it drives. ``copy_groups`` /
``grouped_copy_`` batch the many small copies of a bucket into few ``torch._foreach_copy_``
launches.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from operator import is_
from typing import Any, cast

import attrs
import torch

import policyworker.shell.refit.zmq.ipc_files as ipc_files
from policyworker.functional.buckets import (
    IpcBucket,
    TensorSpec,
)
from policyworker.functional.wire.codec import (
    CudaBuffer,
    ProtocolError,
    ShmBuffer,
)
from policyworker.shell.refit.zmq.ipc_files import create_locked_file, reserve_pages

__all__ = [
    "LARGE_COPY_NUMEL",
    "CudaStaging",
    "ShmStaging",
    "Staging",
    "bucket_slots",
    "cached_copy_groups",
    "copy_groups",
    "grouped_copy_",
    "open_event",
    "run_copy_groups",
]


class ShmStaging:
    """A uint8 staging buffer in a fresh 0600 file under /dev/shm, mapped shared.

    ``cache`` holds per-bucket slot views and encoded frames (see ``ZmqIpcSender.stream``);
    ``close`` drops it with the mapping.
    """

    def __init__(self, nbytes: int) -> None:
        self.name, self.path, self._fd = create_locked_file(ipc_files.SHM_DIR)
        try:
            reserve_pages(self._fd, max(nbytes, 1), self.path)
            self.tensor: torch.Tensor | None = torch.from_file(
                self.path, shared=True, size=max(nbytes, 1), dtype=torch.uint8
            )
        except BaseException:
            os.unlink(self.path)
            os.close(self._fd)
            raise
        self.size = nbytes
        self.base = 0  # where this buffer starts in the shared file (a half starts further in)
        self._file_size = nbytes
        self._owners = [self]  # the objects sharing the file; the last one to close unlinks it
        self.cache: dict[Any, Any] = {}

    def halves(self, nbytes: int) -> tuple[ShmStaging, ShmStaging]:
        """Two buffers of ``nbytes`` over this one's file (which must hold both); consumes self.
        The file is unlinked when both are closed."""
        first, second = _split(self, nbytes)
        self._owners[:] = [first, second]
        return first, second

    def ref(self, *, keep: bool = False) -> ShmBuffer:
        return ShmBuffer(self.name, self._file_size, keep)

    def intact(self) -> bool:
        """The file is still ours, linked under its name, at its full size (a kept buffer that
        someone truncated would SIGBUS the first write into its mapping)."""
        try:
            mine, named = os.fstat(self._fd), os.stat(self.path)
        except OSError:
            return False
        return named.st_ino == mine.st_ino and mine.st_size >= max(self._file_size, 1)

    # Writes through a shared mapping are visible to the peer at once, and the receiver copies
    # synchronously before its ACK: the ordering hooks of CudaStaging have nothing to do here.
    def wait_for_reader(self) -> None:
        pass

    def mark_filled(self) -> None:
        pass

    def note_consumed(self, handle: bytes) -> None:
        pass

    def forget_consumed(self) -> None:
        pass

    def close(self) -> None:
        self.cache.clear()
        self.tensor = None
        if self in self._owners:
            self._owners.remove(self)
            if not self._owners:  # the last view of the file: remove it, then drop our lock
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                os.close(self._fd)


class CudaStaging:
    """A uint8 CUDA staging buffer, shared by the handle of its whole storage (computed once).

    Ordering between the two processes stays on the GPU: the sender records ``filled`` (an
    interprocess event) after queueing the casts into the buffer, the receiver's stream waits on
    it before reading, and the receiver's ACK carries its own event, which the sender's stream
    waits on before writing the buffer again. Neither side blocks its CPU on the GPU per bucket.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.tensor: torch.Tensor | None = torch.empty(
            max(nbytes, 1), dtype=torch.uint8, device=device
        )
        self.size = nbytes
        self.base = (
            0  # where this buffer starts in its shared allocation (a half starts further in)
        )
        self.cache: dict[Any, Any] = {}
        self._ref: CudaBuffer | None = None
        self.filled = torch.cuda.Event(interprocess=True)
        self._consumed: torch.cuda.Event | None = None
        self._consumed_handle = b""

    def halves(self, nbytes: int) -> tuple[CudaStaging, CudaStaging]:
        """Two buffers of ``nbytes`` over this one's allocation (one IPC handle, one mapping on the
        receiver, each half with its own filled event); consumes self."""
        whole = self.ref()  # the handle of the whole allocation, computed once and shared
        pair = _split(self, nbytes)
        for half in pair:
            half.filled = torch.cuda.Event(interprocess=True)
            half._ref = attrs.evolve(whole, filled_event=bytes(half.filled.ipc_handle()))
        return pair

    def ref(self, *, keep: bool = False) -> CudaBuffer:
        if self._ref is None:
            assert self.tensor is not None
            (_, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync) = (
                self.tensor.untyped_storage()._share_cuda_()
            )
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            self._ref = CudaBuffer(
                uuid,
                int(size),
                int(offset),
                int(rc_offset),
                bool(event_sync),
                bytes(handle),
                bytes(rc_handle),
                bytes(event_handle or b""),
                bytes(self.filled.ipc_handle()),
            )
        return attrs.evolve(self._ref, keep=keep)

    def wait_for_reader(self) -> None:
        """Queue (on the current stream) a wait for the receiver's reads.

        Waits for the reads of this buffer's last bucket, before writing or freeing it.
        """
        if self._consumed is not None:
            torch.cuda.current_stream(self.device).wait_event(self._consumed)

    def mark_filled(self) -> None:
        """Record that the casts into this buffer are queued on the current stream.

        The receiver waits on this.
        """
        self.filled.record(torch.cuda.current_stream(self.device))

    def note_consumed(self, handle: bytes) -> None:
        """Remember the receiver's event from the ACK of this buffer's bucket.

        The event is opened once per handle.
        """
        if not handle:
            msg = (
                "the receiver's ACK of a CUDA bucket carries no consumed-event handle "
                "(protocol mismatch)"
            )
            raise ProtocolError(msg)
        if handle != self._consumed_handle:
            self._consumed = open_event(self.device, handle)
            self._consumed_handle = handle

    def forget_consumed(self) -> None:
        """After a complete refit every read is done (the receiver synchronised before COMPLETE)."""
        self._consumed, self._consumed_handle = None, b""

    def intact(self) -> bool:
        return self.tensor is not None

    def close(self) -> None:
        self.cache.clear()
        self.tensor = None
        self._consumed = None


Staging = ShmStaging | CudaStaging


def _split(whole: Any, nbytes: int) -> tuple[Any, Any]:
    """Shallow copies of ``whole`` viewing its bytes at bases 0 and ``nbytes`` (the classes'
    ``halves`` add what each kind needs); ``whole`` gives up its view.

    One allocation for the ping-pong pair halves the per-refit allocations, IPC handles and
    receiver mappings of a refit that frees its staging (opening a mapping costs ~0.5 ms).
    """
    assert whole.tensor is not None and whole.size >= 2 * nbytes and not whole.cache
    halves = []
    for base in (0, nbytes):
        half = copy.copy(whole)
        half.tensor, half.size, half.base, half.cache = (
            whole.tensor[base : base + nbytes],
            nbytes,
            base,
            {},
        )
        halves.append(half)
    whole.tensor = None
    return halves[0], halves[1]


def bucket_slots(
    staging: Staging, bucket: IpcBucket, specs: Sequence[TensorSpec]
) -> list[torch.Tensor]:
    """Typed views of each tensor's slot in the staging bytes."""
    assert staging.tensor is not None
    buf = staging.tensor
    out = []
    for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
        spec = specs[index]
        out.append(buf[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape))
    return out


# At and above this many elements a plain ``copy_`` beats the multi-tensor kernel (H200, 7B
# shapes: a bf16 copy of the large matrices ran 11.0 ms grouped vs 8.1 ms one by one, while for
# the many small tensors of a 1.5B model grouping won, 2.6 vs 3.4 ms: launches dominate there).
LARGE_COPY_NUMEL = 1 << 22


def grouped_copy_(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, non_blocking: bool = False
) -> None:
    """``dsts[k].copy_(srcs[k])`` for every k (casting): large pairs one by one, the rest in as
    few ``_foreach_copy_`` calls as CUDA's multi-tensor fast route allows (see ``copy_groups``)."""
    run_copy_groups(copy_groups(dsts, srcs), non_blocking=non_blocking)


def run_copy_groups(
    groups: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]], *, non_blocking: bool = False
) -> None:
    """Launch the copies of ``copy_groups``: a single pair as ``copy_``, a group as one
    ``_foreach_copy_``."""
    for dsts, srcs in groups:
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0], non_blocking=non_blocking)
        else:
            # torch's grouped copy kernel; public API, just missing from torch's export list
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)  # pyright: ignore[reportPrivateImportUsage]


def open_event(device: torch.device, handle: bytes) -> torch.cuda.Event:
    """The interprocess CUDA event behind ``handle``, opened on ``device``."""
    # Event.from_ipc_handle builds an instance of the class it is called on (a torch.cuda.Event);
    # torch's stubs type it as the C base class, so say what it is.
    return cast(torch.cuda.Event, torch.cuda.Event.from_ipc_handle(device, handle))


def copy_groups(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The ``(destinations, sources)`` lists ``grouped_copy_`` launches, in first-seen order:
    each pair of ``LARGE_COPY_NUMEL`` elements or more alone; the others one group per
    (destination dtype, source dtype) among pairs that are both contiguous, plus one for the rest
    (a mixed list would send the whole call down the one-launch-per-tensor path)."""
    groups: dict[Any, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for position, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        if dst.numel() >= LARGE_COPY_NUMEL:
            key: Any = ("alone", position)
        elif dst.is_contiguous() and src.is_contiguous():
            key = (dst.dtype, src.dtype)
        else:
            key = None
        group = groups.get(key)
        if group is None:
            group = groups[key] = ([], [])
        group[0].append(dst)
        group[1].append(src)
    return list(groups.values())


def cached_copy_groups(
    cache: dict[Any, Any], key: Any, dsts: list[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """``copy_groups(dsts, srcs)``, kept in ``cache[key]`` and reused while ``dsts`` is the same
    list object and ``srcs`` the same tensor objects (compared by identity, and held, so no id
    comes back on another tensor). A grouping is only a launch plan: a source given new data in
    place since (``.data =``, same shape) is still copied right by the same launch."""
    hit = cache.get(key)
    if (
        hit is not None
        and hit[0] is dsts
        and len(hit[1]) == len(srcs)
        and all(map(is_, hit[1], srcs))
    ):
        return hit[2]
    groups = copy_groups(dsts, srcs)
    cache[key] = (dsts, list(srcs), groups)
    return groups

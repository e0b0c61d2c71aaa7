"""Opening a peer's shared buffer: a /dev/shm file by name, or a CUDA allocation by IPC handle.

Both sides of a colocated refit open the other's memory: the receiver maps the sender's staging
buffers (``refit_server.ReceivedBuffers``), and a one-pass sender maps the arena its receiver
registered (``one_pass_sender``). A file is checked before it is mapped (reading a mapping past
a file's end is a SIGBUS, not an error); a CUDA handle is opened on the device named by its
UUID. Nothing is unpickled.

A peer may still shrink its file after the check. ``SharedFile`` holds the file open by
descriptor: the receiver reads a bucket's bytes with ``preadv`` into its own memory (a short
read is an error naming the buffer, never a SIGBUS), and the one-pass sender, which must write
through a mapping, checks the descriptor's size right before and after its writes.
"""

from __future__ import annotations

import os
import stat

import torch

import policyworker.shell.refit.zmq.ipc_files as ipc_files
from policyworker.functional.wire.codec import CudaBuffer, ProtocolError, ShmBuffer

__all__ = ["SharedFile", "open_shared_buffer", "shm_problem"]


def open_shared_buffer(ref: ShmBuffer | CudaBuffer) -> torch.Tensor:
    """A flat uint8 tensor over the peer's buffer (``ProtocolError`` when it cannot be opened)."""
    return _open_shm(ref) if isinstance(ref, ShmBuffer) else _open_cuda(ref)


def shm_problem(ref: ShmBuffer) -> str | None:
    """Why the named staging file cannot be read safely through a mapping of ``ref.size``
    bytes (reading past a file's end is a SIGBUS, not an error); None when it can."""
    path = os.path.join(
        ipc_files.SHM_DIR, ref.name
    )  # the name was checked against a strict pattern
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"shared-memory buffer {ref.name!r} does not exist in {ipc_files.SHM_DIR}"
    if (
        not stat.S_ISREG(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_size < max(ref.size, 1)
    ):
        return (
            f"shared-memory buffer {ref.name!r} is not a regular file of this user with >= "
            f"{ref.size} bytes (it has {info.st_size})"
        )
    return None


def _open_shm(ref: ShmBuffer) -> torch.Tensor:
    problem = shm_problem(ref)
    if problem is not None:
        raise ProtocolError(problem)
    path = os.path.join(ipc_files.SHM_DIR, ref.name)
    return torch.from_file(path, shared=True, size=max(ref.size, 1), dtype=torch.uint8)[: ref.size]


class SharedFile:
    """A peer's /dev/shm file held open by descriptor, so its size can be checked and its bytes
    read without a mapping (a file shrunk under a mapping is a SIGBUS on the next access)."""

    def __init__(self, ref: ShmBuffer) -> None:
        problem = shm_problem(ref)
        if problem is not None:
            raise ProtocolError(problem)
        self.ref = ref
        path = os.path.join(ipc_files.SHM_DIR, ref.name)
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ProtocolError(
                f"shared-memory buffer {ref.name!r} cannot be opened: {exc}"
            ) from None

    def map(self) -> torch.Tensor:
        """A shared mapping of the file this descriptor holds (not whatever bears its name now)."""
        assert self.fd is not None
        path = f"/proc/self/fd/{self.fd}"
        if not os.path.exists(path):  # no procfs: the name, checked just before
            path = os.path.join(ipc_files.SHM_DIR, self.ref.name)
        size = max(self.ref.size, 1)
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)[: self.ref.size]

    def problem(self) -> str | None:
        """Why the file cannot be accessed through ``ref.size`` bytes now (it shrank), or None."""
        assert self.fd is not None
        size = os.fstat(self.fd).st_size
        if size < max(self.ref.size, 1):
            return (
                f"shared-memory buffer {self.ref.name!r} shrank to {size} bytes, below the "
                f"{self.ref.size} it was announced with (its owner truncated it)"
            )
        return None

    def read_into(self, out: torch.Tensor, start: int, end: int) -> None:
        """Copy bytes ``[start, end)`` of the file into the same bytes of ``out`` (flat uint8,
        CPU); ``ProtocolError`` naming the buffer when the file ends before ``end``."""
        assert self.fd is not None
        view = out.numpy().data.cast("B")[start:end]
        done = 0
        while done < end - start:
            got = os.preadv(self.fd, [view[done:]], start + done)
            if got <= 0:
                msg = (
                    f"shared-memory buffer {self.ref.name!r} ended at byte {start + done} while "
                    f"bytes [{start}, {end}) were read (its owner truncated it)"
                )
                raise ProtocolError(msg)
            done += got

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open_cuda(ref: CudaBuffer) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuids = [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    ]
    if ref.device_uuid not in uuids:
        msg = (
            f"CUDA buffer on device {ref.device_uuid} is not visible here (visible: {uuids}); "
            "colocate the receiver"
        )
        raise ProtocolError(msg)
    index = uuids.index(ref.device_uuid)
    return rebuild_cuda_tensor(
        torch.Tensor,
        (ref.size,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        index,
        ref.handle,
        ref.size,
        ref.storage_offset_bytes,
        False,
        ref.ref_counter_handle,
        ref.ref_counter_offset,
        ref.event_handle or None,
        ref.event_sync_required,
    )

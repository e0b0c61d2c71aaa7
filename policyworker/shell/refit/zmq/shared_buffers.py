"""Opening a peer's shared buffer: a /dev/shm file by name, or a CUDA allocation by IPC handle.

Both sides of a colocated refit open the other's memory: the receiver maps the sender's staging
buffers (``refit_server.ReceivedBuffers``), and a one-pass sender maps the arena its receiver
registered (``one_pass_sender``). A file is checked before it is mapped (reading a mapping past
a file's end is a SIGBUS, not an error); a CUDA handle is opened on the device named by its
UUID. Nothing is unpickled.
"""

from __future__ import annotations

import os
import stat

import torch

import policyworker.shell.refit.zmq.ipc_files as ipc_files
from policyworker.functional.wire.codec import CudaBuffer, ProtocolError, ShmBuffer

__all__ = ["open_shared_buffer", "shm_problem"]


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

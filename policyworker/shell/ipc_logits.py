"""Full teacher logits shared in place: a persistent buffer exported once, one record per sample.

For cross-tokenizer distillation (a teacher's logits read by another process): the worker writes
fp32 logits of every microbatch into a persistent storage ``[N_mb, B_mb, S_local, V_local]`` and
returns one handle record per sample; a consumer in another process maps the storage and reads its
sample in place.

- ``TeacherLogitsBuffer.ensure(shape, dtype, device)`` allocates lazily and reallocates (a new
  storage and a new exported handle) only when a dim grows or the dtype/device changes; a
  request that fits returns the same storage and the cached handle. On reallocation every dim
  becomes the max of the old and the requested one, so alternating shapes do not thrash.
- CUDA storages are shared by their CUDA IPC handle (``_share_cuda_()``, computed once); CPU
  storages live in a 0600 file under /dev/shm mapped shared (``staging.ShmStaging``), so CPU
  tests run the real producer and consumer in two processes.
- ``logits_record(...)`` describes one sample's place in the storage; the worker side that
  fills the storage is ``shell.inference.full_logits_ipc`` (its buffer lives in the WorkerState).
- ``open_logits_handle(record)`` maps the storage (once per process and handle) and returns the
  ``actual_shape`` view of the record's sample.

A reallocation orphans handles returned earlier (their storage is released): consumers must open
a call's records before the next call that may grow the buffer.
"""

from __future__ import annotations

import gc
import os
import stat
from collections.abc import Mapping
from typing import Any

import torch

from policyworker.functional.wire.codec import DTYPES_BY_NAME, SHM_NAME_RE, dtype_name
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.refit.zmq.ipc_files import SHM_DIR
from policyworker.shell.refit.zmq.staging import ShmStaging

__all__ = [
    "TeacherLogitsBuffer",
    "close_logits_handles",
    "logits_record",
    "open_logits_handle",
]


class TeacherLogitsBuffer:
    """The producer's persistent logits storage and its exported handle."""

    def __init__(self) -> None:
        self.storage: torch.Tensor | None = None
        self._handle: dict[str, Any] | None = None
        self._shm: ShmStaging | None = None
        self.num_allocations = 0

    def ensure(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A storage of at least ``shape`` (per dim) with this dtype on this device."""
        device = torch.device(device)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            msg = f"shape {list(shape)} must have non-negative dims"
            raise ValueError(msg)
        current = self.storage
        if (
            current is not None
            and current.dtype == dtype
            and _same_device(current.device, device)
            and current.dim() == len(shape)
        ):
            if all(have >= want for have, want in zip(current.shape, shape, strict=True)):
                return current
            shape = tuple(max(have, want) for have, want in zip(current.shape, shape, strict=True))
        self._free()
        nbytes = dtype.itemsize * _numel(shape)
        if device.type == "cpu":
            self._shm = ShmStaging(nbytes)
            assert self._shm.tensor is not None
            self.storage = self._shm.tensor[:nbytes].view(dtype).view(shape)
        else:
            self.storage = torch.empty(shape, dtype=dtype, device=device)
        self.num_allocations += 1
        return self.storage

    @property
    def handle(self) -> dict[str, Any]:
        """The exported handle of the whole storage (computed once per allocation)."""
        if self.storage is None:
            msg = "the logits buffer is not allocated; call ensure(shape, dtype, device) first"
            raise ValueError(msg)
        if self._handle is None:
            if self._shm is not None:
                self._handle = {"kind": "shm", "name": self._shm.name, "size": self._shm.size}
            else:
                storage = self.storage.untyped_storage()
                (_, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync) = (
                    storage._share_cuda_()
                )
                self._handle = {
                    "kind": "cuda",
                    "device_uuid": str(torch.cuda.get_device_properties(self.storage.device).uuid),
                    "handle": bytes(handle),
                    "size": int(size),
                    "storage_offset_bytes": int(offset),
                    "ref_counter_handle": bytes(rc_handle),
                    "ref_counter_offset": int(rc_offset),
                    "event_handle": bytes(event_handle or b""),
                    "event_sync_required": bool(event_sync),
                }
        return self._handle

    def _free(self) -> None:
        self.storage = None
        self._handle = None
        if self._shm is not None:
            self._shm.close()  # unlinks the file; consumers' existing mappings stay valid
            self._shm = None

    def release(self) -> None:
        """Drop the storage and its handle; return cached device memory."""
        cuda = self.storage is not None and self.storage.is_cuda
        self._free()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type == "cpu" or (a.index or 0) == (
        b.index if b.index is not None else torch.cuda.current_device()
    )


# ----------------------------------------------------------------------------- consumer

_OPENED: dict[Any, torch.Tensor] = {}


def _open_storage(payload: Mapping[str, Any]) -> torch.Tensor:
    kind = payload.get("kind")
    if kind == "shm":
        name, size = payload["name"], int(payload["size"])
        if not isinstance(name, str) or not SHM_NAME_RE.match(name):
            msg = (
                f"logits handle names shared memory {name!r}, which does not match "
                f"{SHM_NAME_RE.pattern}"
            )
            raise ValueError(msg)
        key = ("shm", name)
        if key not in _OPENED:
            path = os.path.join(SHM_DIR, name)
            info = os.lstat(path)
            if (
                not stat.S_ISREG(info.st_mode)
                or info.st_uid != os.getuid()
                or info.st_size < max(size, 1)
            ):
                msg = (
                    f"shared-memory logits buffer {name!r} is not a regular file of this user "
                    f"with >= {size} bytes"
                )
                raise ValueError(msg)
            _OPENED[key] = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)[
                :size
            ]
        return _OPENED[key]
    if kind == "cuda":
        key = ("cuda", payload["handle"], payload["storage_offset_bytes"])
        if key not in _OPENED:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            uuids = [
                str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())
            ]
            if payload["device_uuid"] not in uuids:
                msg = (
                    f"logits live on GPU {payload['device_uuid']}, not visible here (visible: "
                    f"{uuids}); colocate"
                )
                raise ValueError(msg)
            size = int(payload["size"])
            _OPENED[key] = rebuild_cuda_tensor(
                torch.Tensor,
                (size,),
                (1,),
                0,
                torch.UntypedStorage,
                torch.uint8,
                uuids.index(payload["device_uuid"]),
                payload["handle"],
                size,
                payload["storage_offset_bytes"],
                False,
                payload["ref_counter_handle"],
                payload["ref_counter_offset"],
                payload["event_handle"] or None,
                payload["event_sync_required"],
            )
        return _OPENED[key]
    msg = f"logits handle kind {kind!r} is unknown; expected 'shm' or 'cuda'"
    raise ValueError(msg)


def open_logits_handle(record: Mapping[str, Any]) -> torch.Tensor:
    """The ``actual_shape`` logits of one sample, a view into the producer's shared storage."""
    dtype = DTYPES_BY_NAME[record["dtype"]]
    storage_shape = tuple(record["storage_shape"])
    raw = _open_storage(record["payload_ipc"])
    nbytes = dtype.itemsize * _numel(storage_shape)
    if raw.numel() < nbytes:
        msg = (
            f"logits storage has {raw.numel()} bytes, the record's storage_shape "
            f"{list(storage_shape)} needs {nbytes}"
        )
        raise ValueError(msg)
    storage = raw[:nbytes].view(dtype).view(storage_shape)
    seq, vocab = record["actual_shape"]
    return storage[record["buf_idx"], record["sample_index_in_buf"], :seq, :vocab]


def close_logits_handles() -> None:
    """Forget every mapping opened in this process (the producer may then free its storage)."""
    _OPENED.clear()
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


def logits_record(
    buffer: TeacherLogitsBuffer,
    storage: torch.Tensor,
    par: ParallelContext,
    buf_idx: int,
    j: int,
    row: int,
    seq_len: int,
    vocab_local: int,
) -> dict[str, Any]:
    """The handle record of sample `row` (slot `j` of microbatch `buf_idx`) in `storage`."""
    tp_rank, tp_size, cp_rank, cp_size = par.tp_rank, par.tp_size, par.cp_rank, par.cp_size
    return {
        "payload_ipc": buffer.handle,
        "buf_idx": buf_idx,
        "sample_index_in_buf": j,
        "sample_index": row,
        "storage_shape": tuple(storage.shape),
        "actual_shape": (seq_len, vocab_local),
        "dtype": dtype_name(storage.dtype),
        "tp_rank": tp_rank,
        "cp_rank": cp_rank,
        "tp_size": tp_size,
        "cp_size": cp_size,
        "world_rank": par.rank,
        "vocab_start_index": tp_rank * vocab_local,
        "vocab_end_index": (tp_rank + 1) * vocab_local,
        "full_vocab_size": vocab_local * tp_size,
        "full_seq_len": seq_len * cp_size,
        "global_seq_start": cp_rank * seq_len,
        "vocab_sharded": tp_size > 1,
        "sequence_sharded": cp_size > 1,
    }

"""SGLang's ``flattened_bucket`` payload of a colocated refit: build it, read it, pickle it safely.

The payload is SGLang's ``load_format="flattened_bucket"`` format:
``{"flattened_tensor": 1-D tensor, "metadata": [record, ...]}`` where each record exposes
``name, shape, dtype, start_idx, end_idx, numel`` as attributes (a ``types.SimpleNamespace``, a
class SGLang's safe unpickler allows). Each bucket holds ONE dtype, flattened in that dtype, with
element offsets: the layout every SGLang version reads (a multi-dtype-capable receiver's byte
view of a single-dtype bucket is a no-op). It is serialized with
``multiprocessing.reduction.ForkingPickler`` (CUDA tensors travel as IPC handles, CPU tensors as
shared memory), one payload per engine TP rank.
``deserialize_payload`` unpickles with an allow-list of globals, so a payload can build nothing
else. The sender and the local engine stand-in that use it are in ``sglang``.
"""

from __future__ import annotations

import io
import math
import pickle
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from policyworker.errors import RefitError

__all__ = [
    "LOAD_FORMAT",
    "NamedTensors",
    "deserialize_payload",
    "flatten_bucket",
    "plan_sglang_chunks",
    "serialize_payload",
    "unflatten_bucket",
]

LOAD_FORMAT = "flattened_bucket"
NamedTensors = Iterable[tuple[str, torch.Tensor]]


def plan_sglang_chunks(sizes: Sequence[int], buffer_size_bytes: int) -> list[list[int]]:
    """Indices per chunk: a chunk is closed before a tensor that would reach ``buffer_size_bytes``.

    A tensor of at least ``buffer_size_bytes`` travels alone (it is never split across chunks).
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and used + size >= buffer_size_bytes:
            chunks.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        chunks.append(current)
    return chunks


def flatten_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One single-dtype bucket: a fresh 1-D tensor of that dtype + per-tensor element ranges."""
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        msg = (
            f"a flattened bucket holds one dtype, got {sorted(str(d) for d in dtypes)}; group by "
            "dtype first"
        )
        raise ValueError(msg)
    metadata, start = [], 0
    for name, tensor in named_tensors:
        numel = tensor.numel()
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(tensor.shape),
                dtype=tensor.dtype,
                start_idx=start,
                end_idx=start + numel,
                numel=numel,
            )
        )
        start += numel
    flat = (
        torch.cat([t.detach().reshape(-1) for _, t in named_tensors])
        if named_tensors
        else torch.empty(0)
    )
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_bucket(payload: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` pairs of a bucket; reads records by attribute as SGLang does.

    Accepts both layouts: element offsets into a typed tensor, or byte offsets into a uint8 one.
    """
    flat = payload["flattened_tensor"]
    out = []
    for meta in payload["metadata"]:
        piece = flat[meta.start_idx : meta.end_idx]
        if piece.dtype != meta.dtype:  # a uint8 (multi-dtype) bucket: byte offsets
            piece = piece.view(meta.dtype)
        if piece.numel() != math.prod(meta.shape):
            msg = (
                f"bucket record {meta.name!r}: {piece.numel()} elements for shape "
                f"{list(meta.shape)}"
            )
            raise RefitError(msg)
        out.append((meta.name, piece.reshape(meta.shape)))
    return out


def serialize_payload(payload: Mapping[str, Any]) -> bytes:
    """SGLang's ``MultiprocessingSerializer.serialize``: ForkingPickler (IPC handles, no data)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(dict(payload))
    return buf.getvalue()


_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", name)
    for name in (
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage",
        "rebuild_storage_fd",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_typed_storage_child",
        "rebuild_nested_tensor",
    )
} | {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("types", "SimpleNamespace"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
}


class _SafeUnpickler(pickle.Unpickler):
    """An exact allowlist, as SGLang's own: tensors, storages, dtypes, SimpleNamespace records."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        msg = f"payload references {module}.{name}, which is not allowed in a weight payload"
        raise RefitError(msg)


def deserialize_payload(data: bytes) -> dict[str, Any]:
    """Inverse of ``serialize_payload`` through an allowlist (never runs arbitrary globals)."""
    payload = _SafeUnpickler(io.BytesIO(data)).load()
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        msg = "a flattened_bucket payload is a dict with exactly 'flattened_tensor' and 'metadata'"
        raise RefitError(msg)
    return payload

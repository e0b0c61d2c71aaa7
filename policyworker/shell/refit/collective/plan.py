"""What both sides of a collective refit agree on: the header, its codec and the bucket plan.

The trainer broadcasts a ``CollectiveHeader`` (JSON after ``[MAGIC, n]``); every rank decodes
it and plans the buckets from it alone (``plan_collective_buckets``), so bucket boundaries and
buffer counts agree by construction. The layouts and limits are in ``collective``'s docstring
and docs/refit-collective.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import torch

# torch.distributed re-exports these without `as`, so the checker sees them as private there.
from policyworker.errors import RefitTimeoutError
from policyworker.functional.buckets import (
    DEFAULT_ALIGNMENT,
    TensorSpec,
    align_up,
    plan_broadcast_buckets,
    plan_ipc_buckets,
)
from policyworker.functional.wire.codec import (
    DTYPES_BY_NAME,
    ProtocolError,
    decode_versioned_json,
    dtype_name,
)

__all__ = [
    "CPU_DEFAULT_BUCKET_BYTES",
    "CUDA_DEFAULT_BUCKET_CAP_BYTES",
    "CUDA_DEFAULT_BUCKET_FRACTION",
    "DEFAULT_NUM_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "MAGIC",
    "MAX_NUM_BUFFERS",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "CollectiveHeader",
    "Layout",
    "PlannedBucket",
    "RefitPeerLostError",
    "decode_header",
    "default_bucket_bytes",
    "encode_header",
    "plan_collective_buckets",
    "specs_from_refit_info",
]

PROTOCOL = "policyworker-collective-refit"
PROTOCOL_VERSION = 1
MAGIC = 0x70777266  # "pwrf": the first int of every header broadcast
DEFAULT_NUM_BUFFERS = 2
DEFAULT_TIMEOUT_S = 600.0
CPU_DEFAULT_BUCKET_BYTES = 64 << 20
CUDA_DEFAULT_BUCKET_CAP_BYTES = 1 << 30  # per slot: large enough to saturate NCCL
CUDA_DEFAULT_BUCKET_FRACTION = 0.02  # of the device's total memory
MAX_NUM_BUFFERS = 64
Layout = Literal["aligned", "legacy"]


class RefitPeerLostError(RefitTimeoutError):
    """A peer's connection dropped mid-refit: the refit can make no more progress."""


# ----------------------------------------------------------------------------- header + plan


@attrs.frozen
class CollectiveHeader:
    """What every rank plans one refit from (sent by trainer rank 0)."""

    refit_seq: int
    layout: Layout
    target_bytes: int
    num_buffers: int
    alignment: int
    manifest: tuple[TensorSpec, ...]


@attrs.frozen
class PlannedBucket:
    """One broadcast: which manifest entries, at which byte offsets, how many bytes travel."""

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int


def encode_header(header: CollectiveHeader) -> bytes:
    """The JSON bytes of a header."""
    body = {
        "protocol": PROTOCOL,
        "version": PROTOCOL_VERSION,
        "refit_seq": header.refit_seq,
        "layout": header.layout,
        "target_bytes": header.target_bytes,
        "num_buffers": header.num_buffers,
        "alignment": header.alignment,
        "manifest": [[s.name, dtype_name(s.dtype), list(s.shape)] for s in header.manifest],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _field_int(body: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(
            f"collective header field {key!r} must be an int in [{low}, {high}], got {value!r:.40}"
        )
    return value


def decode_header(raw: bytes) -> CollectiveHeader:
    """Parse and type-check a header. Raises ``ProtocolError`` with the reason; never evaluates."""
    body = decode_versioned_json(
        raw, protocol=PROTOCOL, version=PROTOCOL_VERSION, what="collective header"
    )
    layout = body.get("layout")
    if layout not in ("aligned", "legacy"):
        raise ProtocolError(
            f"collective header field 'layout' must be 'aligned' or 'legacy', got {layout!r:.40}"
        )
    manifest = body.get("manifest")
    if not isinstance(manifest, list):
        raise ProtocolError(
            f"collective header field 'manifest' must be a list, got {type(manifest).__name__}"
        )
    specs = []
    for i, item in enumerate(manifest):
        ok = (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and 0 < len(item[0]) <= 1024
            and item[1] in DTYPES_BY_NAME
            and isinstance(item[2], list)
            and len(item[2]) <= 16
            and all(type(d) is int and 0 <= d <= 1 << 48 for d in item[2])
        )
        if not ok:
            raise ProtocolError(
                f"collective header manifest[{i}] must be [name, dtype, shape], got {item!r:.80}"
            )
        specs.append(TensorSpec(item[0], tuple(item[2]), DTYPES_BY_NAME[item[1]]))
    return CollectiveHeader(
        _field_int(body, "refit_seq", 0, 1 << 62),
        layout,
        _field_int(body, "target_bytes", 1, 1 << 48),
        _field_int(body, "num_buffers", 1, MAX_NUM_BUFFERS),
        _field_int(body, "alignment", 1, 1 << 20),
        tuple(specs),
    )


def plan_collective_buckets(
    specs: Sequence[TensorSpec],
    *,
    layout: Layout,
    target_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> list[PlannedBucket]:
    """Bucket plan of a refit; both sides call it with the header's values.

    ``aligned``: ``plan_ipc_buckets`` with the target rounded up to the alignment (offsets are
    multiples of ``alignment``; a bucket exceeds the target only as a single oversized tensor).
    ``legacy``: ``plan_broadcast_buckets`` (close after the crossing tensor), offsets are the
    running byte sums (no padding). ``nbytes`` is the end of the last tensor's bytes.
    """
    if layout == "legacy":
        planned = []
        for indices in plan_broadcast_buckets(specs, target_bytes):
            offsets, end = [], 0
            for i in indices:
                offsets.append(end)
                end += specs[i].nbytes
            planned.append(PlannedBucket(tuple(indices), tuple(offsets), end))
        return planned
    buffer_bytes = align_up(target_bytes, alignment)
    return [
        PlannedBucket(
            b.indices,
            b.offsets,
            max(o + specs[i].nbytes for i, o in zip(b.indices, b.offsets, strict=True)),
        )
        for b in plan_ipc_buckets(specs, buffer_bytes, alignment=alignment)
    ]


def default_bucket_bytes(device: torch.device) -> int:
    """The sender's bucket target when ``buffer_size_bytes`` is None.

    Receivers never compute it.
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return max(
            DEFAULT_ALIGNMENT,
            min(int(total * CUDA_DEFAULT_BUCKET_FRACTION), CUDA_DEFAULT_BUCKET_CAP_BYTES),
        )
    return CPU_DEFAULT_BUCKET_BYTES


def specs_from_refit_info(refit_info: Mapping[str, Any]) -> list[TensorSpec]:
    if not refit_info:
        msg = "refit_info is empty; pass prepare_refit_info() of the model being sent"
        raise ValueError(msg)
    return [TensorSpec(name, tuple(shape), dtype) for name, (shape, dtype) in refit_info.items()]

"""Safetensors layout math: which HF tensors a model state has, and where each byte goes.

An HF tensor is a box (a region, `[start, stop)` per dim) of one model tensor (the checkpoint
shell names the boxes from transformers' own save-time conversion), `plan_safetensors_files`
packs them into
`model-0000i-of-0000n.safetensors` files (the header is a function of names, shapes and dtypes
only, so every rank computes the same byte offsets), and `contiguous_runs` lists the row-major
runs of a sub-box inside a box, which is how a shard's bytes land in a file. Pure arithmetic on
shapes: the checkpoint shell (`shell/checkpoint/`) does the reading and writing.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "MAX_FILE_BYTES",
    "MIN_SPREAD_FILE_BYTES",
    "WRITE_STREAMS",
    "Box",
    "box_of_view",
    "FilePlan",
    "HFTensor",
    "contiguous_runs",
    "file_bytes_for_parallel_writes",
    "intersect_boxes",
    "itemsize",
    "plan_safetensors_files",
]

MAX_FILE_BYTES = 5 * 2**30  # HF's default shard size
# A save spreads its weights over about this many files. Buffered writes to one file take its
# inode lock (Linux), so writer threads sharing a file copy into the page cache one at a time
# (docs/checkpoints.md has the measurements). A constant, not the host's thread count: every rank
# must plan the same files.
WRITE_STREAMS = 8
MIN_SPREAD_FILE_BYTES = 256 * 2**20  # below this a model is not split further (tiny models: 1 file)
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim of a model tensor


@attrs.frozen
class HFTensor:
    """One tensor of the HF checkpoint: the `box` region of model tensor `key`, named `name`."""

    name: str
    key: str
    box: Box
    shape: tuple[int, ...]  # the HF shape: the box's sizes, minus a squeezed leading dim
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def box_of_view(view: torch.Tensor, base_shape: Sequence[int]) -> Box:
    """The region of a contiguous `base_shape` tensor that `view` (a slice of it) covers."""
    strides = [math.prod(base_shape[d + 1 :]) for d in range(len(base_shape))]
    rest = int(view.storage_offset())
    start: list[int] = []
    for s in strides:
        start.append(rest // s if s else 0)
        rest = rest % s if s else rest
    sizes = [1] * (len(base_shape) - view.dim()) + list(view.shape)
    return tuple((a, a + n) for a, n in zip(start, sizes, strict=True))


@attrs.frozen
class FilePlan:
    """One safetensors file: its name, header bytes and each tensor's absolute data offset."""

    file: str
    header: bytes
    offsets: dict[str, int]
    size: int


def file_bytes_for_parallel_writes(
    total_bytes: int,
    *,
    streams: int = WRITE_STREAMS,
    min_file_bytes: int = MIN_SPREAD_FILE_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> int:
    """The shard size that spreads `total_bytes` over about `streams` files, kept within
    [`min_file_bytes`, `max_file_bytes`]."""
    return min(max_file_bytes, max(min_file_bytes, -(-total_bytes // max(1, streams))))


def plan_safetensors_files(
    tensors: Sequence[HFTensor], *, max_file_bytes: int = MAX_FILE_BYTES
) -> list[FilePlan]:
    """Split `tensors` (in order) into `model-0000i-of-0000n.safetensors` files and lay them out.

    A file closes before the tensor that would take it past `max_file_bytes` (a larger tensor
    gets a file of its own). Every rank computes the same plan from the same specs.
    """
    groups: list[list[HFTensor]] = [[]]
    used = 0
    for t in tensors:
        if groups[-1] and used + t.nbytes > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append(t)
        used += t.nbytes
    plans: list[FilePlan] = []
    for i, group in enumerate(groups, start=1):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        begin = 0
        for t in group:
            header[t.name] = {
                "dtype": _ST_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [begin, begin + t.nbytes],
            }
            begin += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        head = struct.pack("<Q", len(raw)) + raw
        offsets = {t.name: len(head) + header[t.name]["data_offsets"][0] for t in group}
        plans.append(
            FilePlan(
                f"model-{i:05d}-of-{len(groups):05d}.safetensors", head, offsets, len(head) + begin
            )
        )
    return plans


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """The common region of two boxes, or None when they do not overlap."""
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in box) else box


def contiguous_runs(sub: Box, full: Box) -> Iterator[tuple[int, tuple[int, ...], int]]:
    """Row-major runs of region `sub` inside region `full`: (element offset, leading index, length).

    The leading index selects the run inside the `sub` block (dims before the first partial dim).
    """
    shape = [hi - lo for lo, hi in full]
    sub_shape = [hi - lo for lo, hi in sub]
    start = [s - f for (s, _), (f, _) in zip(sub, full, strict=True)]
    k = len(shape)
    while k > 0 and sub_shape[k - 1] == shape[k - 1]:
        k -= 1
    k = max(k - 1, 0)  # dims >= k+1 are full: a run covers dims k.. of the sub block
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = math.prod(sub_shape[k:])
    for idx in itertools.product(*(range(n) for n in sub_shape[:k])):
        offset = sum((start[d] + i) * strides[d] for d, i in enumerate(idx))
        yield offset + (start[k] * strides[k] if shape else 0), idx, length

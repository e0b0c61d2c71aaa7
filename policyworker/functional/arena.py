"""The one-pass refit's memory layout: where each receiver tensor lives in one shared arena.

A receiver that registers for one-pass refits keeps its weights as views of one arena (one
shared allocation: a CUDA buffer shared by IPC handle, or a /dev/shm file mapped shared).
``plan_arena`` places the receiver's whole (base) tensors in it; a ``Destination`` says where
one manifest entry lives in it (byte offset, shape, element strides, dtype) — a whole tensor or
a piece of one, such as one expert's slice of a fused MoE tensor. ``destination_problems`` is
what a sender checks before it writes a single byte into someone else's memory: every manifest
entry has exactly one destination of its dtype and shape, aligned, inside the arena, and no two
dense destinations overlap.

``destination_view`` and ``destination_of`` are an inverse pair: the typed view of a
destination in a uint8 arena, and the destination a view of the arena describes.

Units: ``offset_bytes`` and spans are bytes from the arena's first byte; ``strides`` are in
elements (torch's). All functions are pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from policyworker.functional.buckets import DEFAULT_ALIGNMENT, TensorSpec, align_up

__all__ = [
    "ArenaPlan",
    "Destination",
    "destination_of",
    "destination_problems",
    "destination_span",
    "destination_view",
    "ordered_destinations",
    "plan_arena",
]

_MAX_REPORTED = 20  # problems named per kind; a rejection stays readable


@attrs.frozen
class ArenaPlan:
    """``offsets[k]``: the byte offset of base tensor ``k`` in the arena; ``total_bytes``: the
    arena's size (the aligned end of the last tensor)."""

    offsets: tuple[int, ...]
    total_bytes: int


@attrs.frozen
class Destination:
    """Where manifest entry ``name`` lives in the arena: ``dtype`` elements of ``shape`` with
    element ``strides``, the first one at byte ``offset_bytes``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    strides: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    offset_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_dense(self) -> bool:
        """Its elements fill its span with no gaps (so the span overlap test is exact)."""
        return _dense(self.shape, self.strides)


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(shape, strides, strict=True) if s != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def plan_arena(nbytes: Sequence[int], *, alignment: int = DEFAULT_ALIGNMENT) -> ArenaPlan:
    """Place tensors of ``nbytes`` back to back, each at an ``alignment``-byte boundary.

    Raises:
        ValueError: a size is negative or ``alignment`` is not a positive power of two.
    """
    if alignment < 1 or alignment & (alignment - 1):
        msg = f"alignment {alignment} must be a positive power of two (e.g. 512)"
        raise ValueError(msg)
    offsets: list[int] = []
    end = 0
    for index, size in enumerate(nbytes):
        if size < 0:
            msg = f"nbytes[{index}] is {size}; a tensor's byte count is >= 0"
            raise ValueError(msg)
        offset = align_up(end, alignment)
        offsets.append(offset)
        end = offset + size
    return ArenaPlan(tuple(offsets), align_up(end, alignment))


def destination_span(dest: Destination) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` between the first and past the last element it touches (an empty
    span at its offset when it has no elements)."""
    if dest.numel == 0:
        return dest.offset_bytes, dest.offset_bytes
    reach = sum((size - 1) * stride for size, stride in zip(dest.shape, dest.strides, strict=True))
    return dest.offset_bytes, dest.offset_bytes + (reach + 1) * dest.dtype.itemsize


def _shown(names: Sequence[str]) -> str:
    listed = ", ".join(repr(n) for n in names[:_MAX_REPORTED])
    return listed + (f", ... ({len(names)} in all)" if len(names) > _MAX_REPORTED else "")


def _layout_problem(dest: Destination, arena_bytes: int) -> str | None:
    itemsize = dest.dtype.itemsize
    if len(dest.strides) != len(dest.shape) or min(dest.strides, default=0) < 0:
        return f"{dest.name!r}: strides {list(dest.strides)} must be >= 0, one per dimension"
    if dest.offset_bytes < 0 or dest.offset_bytes % itemsize:
        return f"{dest.name!r}: offset {dest.offset_bytes} is not a multiple of {itemsize} >= 0"
    lo, hi = destination_span(dest)
    if hi > arena_bytes:
        return f"{dest.name!r}: bytes [{lo}, {hi}) run past the arena's {arena_bytes} bytes"
    return None


def destination_problems(
    manifest: Sequence[TensorSpec], destinations: Sequence[Destination], *, arena_bytes: int
) -> list[str]:
    """Every reason the sender must not write ``manifest`` into these destinations (empty: fine).

    Checked: each manifest name has exactly one destination and each destination a manifest
    name; dtypes and shapes agree; offsets are aligned to the element size; strides are
    non-negative; every element lies inside the arena's ``arena_bytes``; and no two dense
    destinations share a byte. (Strided pieces of one fused tensor interleave by design: their
    disjointness is the receiver's own layout check, not something a span test can decide.)
    """
    problems: list[str] = []
    wanted = {spec.name: spec for spec in manifest}
    seen: dict[str, int] = {}
    for dest in destinations:
        seen[dest.name] = seen.get(dest.name, 0) + 1
    duplicates = [name for name, count in seen.items() if count > 1]
    if duplicates:
        problems.append(f"destinations named twice: {_shown(duplicates)}")
    missing = [name for name in wanted if name not in seen]
    if missing:
        problems.append(f"manifest entries with no registered destination: {_shown(missing)}")
    unexpected = [name for name in seen if name not in wanted]
    if unexpected:
        problems.append(f"registered destinations not in the manifest: {_shown(unexpected)}")
    mismatched = [
        f"{d.name!r} is {d.dtype}{list(d.shape)} vs manifest "
        f"{wanted[d.name].dtype}{list(wanted[d.name].shape)}"
        for d in destinations
        if d.name in wanted and (d.dtype, d.shape) != (wanted[d.name].dtype, wanted[d.name].shape)
    ]
    if mismatched:
        problems.append("dtype/shape mismatches: " + "; ".join(mismatched[:_MAX_REPORTED]))
    layout = [p for d in destinations if (p := _layout_problem(d, arena_bytes)) is not None]
    problems.extend(layout[:_MAX_REPORTED])
    spans = sorted((destination_span(d), d.name) for d in destinations if d.is_dense and d.numel)
    overlaps = [
        f"{a!r} [{lo_a}, {hi_a}) overlaps {b!r} [{lo_b}, {hi_b})"
        for ((lo_a, hi_a), a), ((lo_b, hi_b), b) in zip(spans, spans[1:], strict=False)
        if lo_b < hi_a
    ]
    if overlaps:
        problems.append("overlapping destinations: " + "; ".join(overlaps[:_MAX_REPORTED]))
    return problems


def ordered_destinations(
    manifest: Sequence[TensorSpec], destinations: Sequence[Destination]
) -> tuple[Destination, ...]:
    """The destinations in manifest order (``destination_problems`` must be empty first).

    Raises:
        ValueError: a manifest name has no destination.
    """
    by_name = {d.name: d for d in destinations}
    missing = [s.name for s in manifest if s.name not in by_name]
    if missing:
        msg = (
            f"manifest entries with no registered destination: {_shown(missing)}; run "
            "destination_problems first and refuse the write"
        )
        raise ValueError(msg)
    return tuple(by_name[s.name] for s in manifest)


def destination_view(arena: torch.Tensor, dest: Destination) -> torch.Tensor:
    """The typed, writable view of ``dest`` in a flat uint8 ``arena`` (no copy).

    Raises:
        ValueError: ``arena`` is not a flat contiguous uint8 tensor holding the destination.
    """
    lo, hi = destination_span(dest)
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        msg = f"arena must be a flat contiguous uint8 tensor, got {arena.dtype}{list(arena.shape)}"
        raise ValueError(msg)
    if hi > arena.numel() or lo % dest.dtype.itemsize:
        msg = f"{dest.name!r}: bytes [{lo}, {hi}) do not fit an arena of {arena.numel()} bytes"
        raise ValueError(msg)
    typed = arena[lo:hi].view(dest.dtype)
    return typed.as_strided(dest.shape, dest.strides, typed.storage_offset())


def destination_of(view: torch.Tensor, arena: torch.Tensor, *, name: str) -> Destination:
    """The destination that ``view`` (a view into the uint8 ``arena``) describes.

    Raises:
        ValueError: ``view`` does not lie inside ``arena``'s bytes.
    """
    # storage offsets, not data pointers: an empty view's data pointer is 0
    offset = int(view.storage_offset()) * view.element_size() - int(arena.storage_offset())
    dest = Destination(name, view.dtype, tuple(view.shape), tuple(view.stride()), offset)
    problem = _layout_problem(dest, arena.numel())
    same_storage = view.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    if problem is not None or not same_storage:
        msg = f"{name!r} is not a view inside the arena ({problem or 'another storage'})"
        raise ValueError(msg)
    return dest

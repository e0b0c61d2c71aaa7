"""What a receiver checks BEFORE it writes anything: the manifest and each bucket.

``check_manifest`` compares an announced manifest with the receiver's ``refit_info``;
``check_bucket`` checks one bucket's indices, offsets and sizes against that manifest and its
buffer. Both return every problem found (empty: fine), so one rejection names them all.
``self_overlap_problem`` refuses a one-pass destination whose elements may share memory (a
write into it is undefined, and torch refuses it only once the sender is mid-refit).
All functions are pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from policyworker.functional.buckets import TensorSpec
from policyworker.functional.wire.messages import Bucket, dtype_name

__all__ = ["check_bucket", "check_manifest", "self_overlap_problem"]


def _first(names: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_manifest(
    manifest: Sequence[TensorSpec], expected: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> list[str]:
    """Problems of an announced manifest against the receiver's refit metadata (empty = fine)."""
    problems: list[str] = []
    seen: set[str] = set()
    duplicates: list[str] = []
    for spec in manifest:
        if spec.name in seen:
            duplicates.append(spec.name)
        seen.add(spec.name)
    if duplicates:
        problems.append(f"duplicate names: {_first(duplicates)}")
    unexpected = [s.name for s in manifest if s.name not in expected]
    if unexpected:
        problems.append(f"unexpected names (not in refit_info): {_first(unexpected)}")
    missing = [n for n in expected if n not in seen]
    if missing:
        problems.append(f"missing names (in refit_info, not sent): {_first(missing)}")
    mismatched = [
        f"{s.name!r} sent {dtype_name(s.dtype)}{list(s.shape)} vs refit_info "
        f"{dtype_name(expected[s.name][1])}{list(expected[s.name][0])}"
        for s in manifest
        if s.name in expected
        and (s.shape != tuple(expected[s.name][0]) or s.dtype != expected[s.name][1])
    ]
    if mismatched:
        problems.append("dtype/shape mismatches: " + "; ".join(mismatched[:20]))
    return problems


def check_bucket(
    bucket: Bucket,
    manifest: Sequence[TensorSpec],
    sizes: Sequence[int],
    received: bytearray,
    *,
    alignment: int,
    buffer_size: int,
) -> list[str]:
    """Problems of one bucket against the announced manifest and its buffer (empty = fine).

    ``sizes[i]`` is ``manifest[i].nbytes``; ``received[i]`` is non-zero once tensor ``i`` arrived.
    """
    problems: list[str] = []
    used = bucket.used_bytes
    if not used <= buffer_size:
        problems.append(f"used_bytes {used} exceeds the buffer size {buffer_size}")
    count = len(manifest)
    end = 0
    seen: set[int] = set()
    for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
        if index >= count:
            problems.append(f"tensor index {index} is outside the manifest of {count} tensors")
            continue
        if received[index] or index in seen:
            problems.append(f"duplicate name {manifest[index].name!r} (already received)")
        seen.add(index)
        if offset % alignment or offset < end:
            problems.append(
                f"{manifest[index].name!r}: offset {offset} is not {alignment}-aligned after the "
                f"previous tensor's end {end}"
            )
        end = offset + sizes[index]
        if end > used:
            problems.append(
                f"{manifest[index].name!r}: byte range [{offset}, {end}) exceeds used_bytes {used}"
            )
    return problems


def self_overlap_problem(name: str, shape: Sequence[int], strides: Sequence[int]) -> str | None:
    """Why a strided destination of ``shape``/``strides`` (in elements) may map two of its
    elements to one memory location, or None when it cannot.

    Sufficient, not exact: the dimensions of size > 1, taken by increasing stride, must each
    step past everything the smaller ones reach (``stride >= reach + 1``). Every layout a
    tensor gets from ``contiguous()``, a permute or a slice of one passes; a zero stride on a
    dimension of size > 1 (``expand``) never does.
    """
    if len(shape) != len(strides):
        return f"{name!r}: {len(strides)} strides for {len(shape)} dimensions"
    dims = sorted((st, size) for size, st in zip(shape, strides, strict=True) if size > 1)
    if any(size == 0 for size in shape):
        return None  # no element at all
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            return (
                f"{name!r}: shape {list(shape)} with strides {list(strides)} lets two elements "
                "share memory (a zero or too-small stride); register a tensor whose elements "
                "are distinct (call .contiguous() on it)"
            )
        reach += (size - 1) * stride
    return None

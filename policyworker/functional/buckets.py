"""Bucket plans for refit transports and byte-exact packing of tensors into a uint8 buffer.

Two planners, one per transport family:

- ``plan_ipc_buckets``: the colocated ZMQ + IPC plan. Two ping-pong staging buffers of
  ``buffer_bytes`` each; every tensor starts at a multiple of ``alignment`` bytes; a bucket is
  flushed when the next tensor does not fit; a tensor whose aligned size exceeds a buffer travels
  alone in an exact-size buffer (``oversized``).
- ``plan_broadcast_buckets``: the packed-broadcast plan. No padding; a bucket closes right AFTER
  the tensor that makes its cumulative size exceed ``target_bytes`` (so a bucket may exceed the
  target, and a huge tensor is a bucket of its own).

Packing is cast-free: a tensor's raw bytes are copied, whatever its dtype, shape (0-d included)
or strides. All functions are pure: ``pack_tensors`` writes only into the buffer it is given as
its output argument.
"""

import math
from collections.abc import Sequence

import attrs
import torch

__all__ = [
    "DEFAULT_ALIGNMENT",
    "IpcBucket",
    "TensorSpec",
    "align_up",
    "default_ipc_buffer_bytes",
    "default_ipc_buffer_bytes_from",
    "ipc_size_stats",
    "pack_tensors",
    "plan_broadcast_buckets",
    "plan_ipc_buckets",
    "split_ipc_budget",
    "SplitLayout",
    "split_layout",
    "split_views",
    "tensor_bytes",
    "unpack_tensors",
]

DEFAULT_ALIGNMENT = 512


@attrs.frozen
class TensorSpec:
    """Name, shape and dtype of one tensor as it travels on the wire."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        """The spec of ``tensor`` under ``name``."""
        return cls(name, tuple(tensor.shape), tensor.dtype)


@attrs.frozen
class IpcBucket:
    """One message of the ZMQ + IPC plan: which tensors, where in the buffer, how many bytes.

    ``offsets[i]`` is the byte offset of ``names[i]``; ``used_bytes`` is the aligned end of the
    last tensor (the bytes the receiver may read). ``oversized`` buckets hold exactly one tensor
    and need their own buffer of ``used_bytes``.
    """

    indices: tuple[int, ...]
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    used_bytes: int
    oversized: bool


def align_up(n: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """The smallest multiple of ``alignment`` that is >= ``n``."""
    if alignment < 1:
        msg = f"alignment {alignment} must be >= 1 byte"
        raise ValueError(msg)
    return -(-n // alignment) * alignment


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()


def split_ipc_budget(
    total_bytes: int, *, num_buffers: int = 2, alignment: int = DEFAULT_ALIGNMENT
) -> int:
    """Per-buffer bytes of a total staging budget: an equal share rounded up to the alignment.

    Raises:
        ValueError: ``total_bytes`` is not positive.
    """
    if total_bytes <= 0:
        msg = f"buffer_size_bytes {total_bytes} must be > 0 (or 0 to pick a default)"
        raise ValueError(msg)
    return align_up(-(-total_bytes // num_buffers), alignment)


def ipc_size_stats(
    specs: Sequence[TensorSpec], alignment: int = DEFAULT_ALIGNMENT
) -> tuple[int, int]:
    """``(largest, total)`` aligned bytes of a stream (``alignment`` when it is empty)."""
    sizes = [align_up(s.nbytes, alignment) for s in specs]
    return max(sizes, default=alignment), sum(sizes)


def default_ipc_buffer_bytes_from(
    largest: int,
    total: int,
    *,
    cap_bytes: int,
    free_bytes: int | None = None,
    free_fraction: float = 0.125,
    alignment: int = DEFAULT_ALIGNMENT,
) -> int:
    """``default_ipc_buffer_bytes`` from the stream's ``ipc_size_stats`` (no walk over specs)."""
    target = cap_bytes if free_bytes is None else min(cap_bytes, int(free_bytes * free_fraction))
    target = max(
        align_up(max(min(target, total), 1), alignment), alignment
    )  # a small model: one bucket
    if largest > target and (free_bytes is None or 4 * largest <= free_bytes):
        return largest
    return target


def default_ipc_buffer_bytes(
    specs: Sequence[TensorSpec],
    *,
    cap_bytes: int,
    free_bytes: int | None = None,
    free_fraction: float = 0.125,
    alignment: int = DEFAULT_ALIGNMENT,
) -> int:
    """Per-buffer size when the caller passes ``buffer_size_bytes=0``.

    ``min(cap_bytes, free_fraction * free_bytes)``, raised to the largest aligned tensor when two
    such buffers still fit in half the free memory (so the largest tensor, usually the embedding,
    is not "oversized" and no exact-size buffer is allocated mid-refit), and never above the whole
    stream's aligned size (a small model is one bucket). ``free_bytes=None``
    (CPU shared memory) means no free-memory limit.
    """
    largest, total = ipc_size_stats(specs, alignment)
    return default_ipc_buffer_bytes_from(
        largest,
        total,
        cap_bytes=cap_bytes,
        free_bytes=free_bytes,
        free_fraction=free_fraction,
        alignment=alignment,
    )


def plan_ipc_buckets(
    specs: Sequence[TensorSpec], buffer_bytes: int, *, alignment: int = DEFAULT_ALIGNMENT
) -> list[IpcBucket]:
    """Group tensors, in order, into buckets of at most ``buffer_bytes`` (aligned offsets).

    Example (``buffer_bytes=2048``): sizes [512, 3072, 512] give [512] [3072 alone, oversized]
    [512]; [2048] fits exactly; [2049] aligns to 2560 and is oversized.

    Raises:
        ValueError: ``buffer_bytes`` is not a positive multiple of ``alignment``.
    """
    if buffer_bytes <= 0 or buffer_bytes % alignment:
        msg = (
            f"buffer_bytes {buffer_bytes} must be a positive multiple of the alignment "
            f"{alignment}; round it with align_up"
        )
        raise ValueError(msg)
    buckets: list[IpcBucket] = []
    current: list[tuple[int, int]] = []  # (index, offset)
    used = 0

    def flush() -> None:
        nonlocal current, used
        if current:
            idx = tuple(i for i, _ in current)
            buckets.append(
                IpcBucket(
                    idx,
                    tuple(specs[i].name for i in idx),
                    tuple(o for _, o in current),
                    used,
                    False,
                )
            )
        current, used = [], 0

    for index, spec in enumerate(specs):
        size = align_up(spec.nbytes, alignment)
        if size > buffer_bytes:
            flush()
            buckets.append(IpcBucket((index,), (spec.name,), (0,), size, True))
            continue
        if used + size > buffer_bytes:
            flush()
        current.append((index, used))
        used += size
    flush()
    return buckets


def plan_broadcast_buckets(specs: Sequence[TensorSpec], target_bytes: int) -> list[list[int]]:
    """Indices of each packed-broadcast bucket: close right after the tensor crossing the target.

    Raises:
        ValueError: ``target_bytes`` is not positive.
    """
    if target_bytes <= 0:
        msg = f"target_bytes {target_bytes} must be > 0"
        raise ValueError(msg)
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, spec in enumerate(specs):
        current.append(index)
        used += spec.nbytes
        if used > target_bytes:
            buckets.append(current)
            current, used = [], 0
    if current:
        buckets.append(current)
    return buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous copy (or of the tensor itself when contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def pack_tensors(
    tensors: Sequence[torch.Tensor], offsets: Sequence[int], buffer_uint8: torch.Tensor
) -> None:
    """Copy each tensor's raw bytes into ``buffer_uint8[offset : offset + nbytes]`` (no cast).

    ``buffer_uint8`` is the output argument: a 1-D uint8 tensor large enough for every range.

    Raises:
        ValueError: the buffer is not 1-D uint8, the lengths differ, or a range does not fit.
    """
    if buffer_uint8.dtype != torch.uint8 or buffer_uint8.dim() != 1:
        msg = (
            f"buffer must be a 1-D uint8 tensor, got {buffer_uint8.dtype} "
            f"with shape {tuple(buffer_uint8.shape)}"
        )
        raise ValueError(msg)
    if len(tensors) != len(offsets):
        msg = f"{len(tensors)} tensors but {len(offsets)} offsets; pass one offset per tensor"
        raise ValueError(msg)
    for tensor, offset in zip(tensors, offsets, strict=True):
        size = tensor_bytes(tensor)
        if offset < 0 or offset + size > buffer_uint8.numel():
            msg = (
                f"byte range [{offset}, {offset + size}) does not fit a buffer "
                f"of {buffer_uint8.numel()} bytes"
            )
            raise ValueError(msg)
        if size:
            buffer_uint8[offset : offset + size].copy_(_as_bytes(tensor.detach()))


def unpack_tensors(
    buffer_uint8: torch.Tensor, specs: Sequence[TensorSpec], offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Views (clones when a slice is misaligned for its dtype) of each spec's bytes in the buffer.

    Raises:
        ValueError: the lengths differ or a range does not fit the buffer.
    """
    if len(specs) != len(offsets):
        msg = f"{len(specs)} specs but {len(offsets)} offsets; pass one offset per spec"
        raise ValueError(msg)
    out: list[torch.Tensor] = []
    for spec, offset in zip(specs, offsets, strict=True):
        size = spec.nbytes
        if offset < 0 or offset + size > buffer_uint8.numel():
            msg = (
                f"tensor {spec.name!r}: byte range [{offset}, {offset + size}) "
                f"does not fit a buffer of {buffer_uint8.numel()} bytes"
            )
            raise ValueError(msg)
        raw = buffer_uint8[offset : offset + size]
        itemsize = spec.dtype.itemsize
        if raw.storage_offset() % itemsize or raw.data_ptr() % itemsize:
            raw = raw.clone()  # a view must start at a multiple of the element size
        out.append(raw.view(spec.dtype).reshape(spec.shape))
    return out


@attrs.frozen
class SplitLayout:
    """One dtype's cut of a buffer into a bucket's tensors: ``split_sizes`` (elements) cover
    ``[0, end_bytes)`` with tensors and the gaps between them; tensor k is part ``picks[k]``."""

    dtype: torch.dtype
    split_sizes: tuple[int, ...]
    picks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    end_bytes: int


def split_layout(specs: Sequence[TensorSpec], offsets: Sequence[int]) -> SplitLayout | None:
    """The ``SplitLayout`` of tensors of one dtype at ascending, element-aligned, non-overlapping
    byte offsets; None when they do not qualify (then use ``unpack_tensors``).

    Example: two float32 tensors of 3 and 2 elements at byte offsets 0 and 512 give split sizes
    ``(3, 125, 2)`` and picks ``(0, 2)``.
    """
    if len(specs) != len(offsets) or not specs:
        return None
    dtype = specs[0].dtype
    itemsize = dtype.itemsize
    sizes: list[int] = []
    picks: list[int] = []
    end = 0
    for spec, offset in zip(specs, offsets, strict=True):
        if spec.dtype != dtype or offset % itemsize or offset < end:
            return None
        if offset > end:
            sizes.append((offset - end) // itemsize)
        picks.append(len(sizes))
        sizes.append(spec.numel)
        end = offset + spec.nbytes
    return SplitLayout(dtype, tuple(sizes), tuple(picks), tuple(s.shape for s in specs), end)


def split_views(buffer_uint8: torch.Tensor, layout: SplitLayout) -> list[torch.Tensor]:
    """The tensors of ``layout`` as views of the buffer: one typed view, one split, one reshape
    each (``unpack_tensors`` costs a few more tensor operations per tensor).

    Raises:
        ValueError: the buffer is shorter than the layout or not aligned for its dtype.
    """
    itemsize = layout.dtype.itemsize
    if buffer_uint8.numel() < layout.end_bytes or (
        buffer_uint8.data_ptr() % itemsize and layout.end_bytes
    ):
        msg = (
            f"a buffer of {buffer_uint8.numel()} bytes at address "
            f"{buffer_uint8.data_ptr():#x} cannot hold this layout "
            f"({layout.end_bytes} bytes of {layout.dtype}); use unpack_tensors"
        )
        raise ValueError(msg)
    flat = buffer_uint8[: layout.end_bytes].view(layout.dtype)
    parts = torch.split(flat, list(layout.split_sizes))
    return [parts[p].view(shape) for p, shape in zip(layout.picks, layout.shapes, strict=True)]

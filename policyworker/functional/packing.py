"""Sequence packing: pack/unpack right-padded rows, cu_seqlens, restarted positions, bin packing.

Shape legend: ``B`` batch, ``S`` sequence, ``N`` packed tokens (``sum(lengths)``), ``...`` any
trailing dims (e.g. ``K`` for top-k). A right-padded row holds its ``len_b`` real entries at
``[0, len_b)``.

Worked example::

    x_BS = [[1, 2, 0],        lengths_B = [2, 3]
            [3, 4, 5]]
    pack(x_BS, lengths_B)  -> x_N = [1, 2, 3, 4, 5], cu_seqlens = [0, 2, 5]   (int32)
    packed_position_ids([2, 3]) -> [0, 1, 0, 1, 2]
    unpack(x_N, cu_seqlens, seq_len=3) -> [[1, 2, 0], [3, 4, 5]]

    pack_into_bins([46, 24, 55, 88, 11, 14, 73, 17], 100,
                   algorithm="modified_first_fit_decreasing")
      large (> 50): 88, 73, 55 open one bin each       -> [3], [6], [2]
      medium (33, 50]: 46 fits no large bin            -> (left for the last phase)
      small (16, 33], backwards: 55 takes 17 then 24   -> [3], [6], [2, 7, 1]
      rest, first fit decreasing: 46 opens a bin, 14 -> 73's bin, 11 -> 88's bin
      => [[3, 4], [6, 5], [2, 7, 1], [0]]   (loads 99, 87, 96, 46)

All functions are pure: they never modify their arguments and read no runtime state.
"""

import random
from collections.abc import Sequence
from typing import Literal, get_args

import torch

__all__ = [
    "PackingAlgorithm",
    "cu_seqlens_from_lengths",
    "pack",
    "pack_into_bins",
    "packed_position_ids",
    "packed_token_slots",
    "packing_efficiency",
    "unpack",
]

PackingAlgorithm = Literal[
    "first_fit_decreasing", "modified_first_fit_decreasing", "first_fit_shuffle", "concatenative"
]
_ALGORITHMS: tuple[str, ...] = get_args(PackingAlgorithm)


def int_list(values: Sequence[int] | torch.Tensor) -> list[int]:
    """Python ints of a 1-D tensor (one host sync) or of a sequence."""
    if isinstance(values, torch.Tensor):
        # torch's stubs type tolist() as list[Unknown]; a 1-D integer tensor gives ints
        as_list: list[int] = values.reshape(-1).tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
        return [int(v) for v in as_list]
    return [int(v) for v in values]


def _check_lengths(lengths_B: torch.Tensor, seq_len: int | None = None) -> None:
    if lengths_B.ndim != 1 or lengths_B.dtype.is_floating_point or lengths_B.dtype == torch.bool:
        raise ValueError(
            f"lengths_B must be a 1-D integer tensor, got shape {tuple(lengths_B.shape)} and dtype "
            f"{lengths_B.dtype}; pass one integer length per row"
        )
    if lengths_B.numel() and int(lengths_B.min()) < 0:
        raise ValueError(f"lengths_B must be >= 0, got min {int(lengths_B.min())}")
    if seq_len is not None and lengths_B.numel() and int(lengths_B.max()) > seq_len:
        raise ValueError(
            f"lengths_B must be <= the sequence width {seq_len}, got max {int(lengths_B.max())}; "
            "fix the lengths or widen the batch"
        )


def cu_seqlens_from_lengths(lengths_B: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence starts ``[0, l0, l0+l1, ...]`` (int32 [B+1]), as varlen kernels take."""
    _check_lengths(lengths_B)
    cu = torch.zeros(lengths_B.shape[0] + 1, dtype=torch.int32, device=lengths_B.device)
    cu[1:] = torch.cumsum(lengths_B, dim=0).to(torch.int32)
    return cu


def pack(x_BS: torch.Tensor, lengths_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate each row's first ``len_b`` entries: ``[B, S, ...] -> ([N, ...], cu_seqlens)``."""
    if x_BS.ndim < 2:
        raise ValueError(f"x_BS must be at least 2-D [B, S, ...], got shape {tuple(x_BS.shape)}")
    if lengths_B.shape != (x_BS.shape[0],):
        raise ValueError(
            f"lengths_B must have shape [{x_BS.shape[0]}] (one per row of x_BS "
            f"{tuple(x_BS.shape)}), got {tuple(lengths_B.shape)}"
        )
    _check_lengths(lengths_B, x_BS.shape[1])
    positions_S = torch.arange(x_BS.shape[1], device=x_BS.device)
    mask_BS = positions_S[None, :] < lengths_B.to(x_BS.device)[:, None]
    return x_BS[mask_BS], cu_seqlens_from_lengths(lengths_B)


def unpack(
    x_N: torch.Tensor, cu_seqlens: torch.Tensor, *, seq_len: int, pad_value: float | int = 0
) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[N, ...] -> [B, seq_len, ...]``, right-padded with pad_value."""
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D and start at 0, got {int_list(cu_seqlens)}")
    lengths_B = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    _check_lengths(lengths_B, seq_len)
    if x_N.ndim < 1 or x_N.shape[0] != int(cu_seqlens[-1]):
        raise ValueError(
            f"x_N has {x_N.shape[0] if x_N.ndim else 0} packed entries but cu_seqlens[-1] is "
            f"{int(cu_seqlens[-1])}; pass the cu_seqlens that pack() returned with this tensor"
        )
    out = torch.full(
        (lengths_B.shape[0], seq_len, *x_N.shape[1:]), pad_value, dtype=x_N.dtype, device=x_N.device
    )
    mask_BS = torch.arange(seq_len, device=x_N.device)[None, :] < lengths_B.to(x_N.device)[:, None]
    out[mask_BS] = x_N
    return out


def packed_token_slots(lengths_B: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Where each packed token sits in the flattened ``[B * seq_len]`` padded grid (int64 [N]).

    ``padded.reshape(B * seq_len, ...)[slots] = x_N`` is :func:`unpack` without a boolean mask,
    so a caller that computes the slots on the host scatters on a device without waiting for it.
    """
    _check_lengths(lengths_B, seq_len)
    positions_BS = torch.arange(seq_len, device=lengths_B.device).expand(lengths_B.shape[0], -1)
    mask_BS = positions_BS < lengths_B.to(torch.int64)[:, None]
    return torch.nonzero(mask_BS.reshape(-1), as_tuple=False).reshape(-1)


def packed_position_ids(lengths_B: torch.Tensor) -> torch.Tensor:
    """Position ids of the packed tokens, restarting at 0 per sequence (int64 [N])."""
    cu = cu_seqlens_from_lengths(lengths_B).to(torch.int64)
    total = int(cu[-1])
    starts_N = torch.repeat_interleave(cu[:-1], lengths_B.to(torch.int64), output_size=total)
    return torch.arange(total, dtype=torch.int64, device=lengths_B.device) - starts_N


# ---------------------------------------------------------------------------------------------
# Bin packing. Bins are lists of indices into ``lengths``; a bin's load is the sum of its lengths.


def pack_into_bins(
    lengths: Sequence[int] | torch.Tensor,
    capacity: int,
    *,
    algorithm: PackingAlgorithm,
    min_bin_count: int = 1,
    bin_count_multiple: int = 1,
    seed: int = 0,
) -> list[list[int]]:
    """Group sequence indices into bins whose total length is at most ``capacity``.

    Bins come out in creation order, indices inside a bin in insertion order. Afterwards, while
    the bin count is below ``min_bin_count`` or not a multiple of ``bin_count_multiple``, the
    largest sequence of the fullest bin holding two or more sequences moves into a new bin.
    No sequences make no bins (``[]``, as NeMo-RL's packers return), whatever the bin-count
    arguments say.

    Args:
        algorithm: ``first_fit_decreasing``; ``modified_first_fit_decreasing`` (Johnson & Garey's
            MFFD: large/medium/small/tiny classes); ``first_fit_shuffle`` (first fit over a
            ``seed``-shuffled order); ``concatenative`` (input order, a new bin when full).

    Raises:
        ValueError: unknown algorithm; a length that is negative or above ``capacity``; a bin
            count that cannot be reached because there are too few (but some) sequences.
    """
    sizes = int_list(lengths)
    _check_bin_arguments(sizes, capacity, algorithm, min_bin_count, bin_count_multiple)
    if not sizes:
        return []
    if algorithm == "first_fit_decreasing":
        bins = _first_fit(sizes, _decreasing(sizes), capacity, [])
    elif algorithm == "modified_first_fit_decreasing":
        bins = _modified_first_fit_decreasing(sizes, capacity)
    elif algorithm == "first_fit_shuffle":
        order = list(range(len(sizes)))
        random.Random(seed).shuffle(order)
        bins = _first_fit(sizes, order, capacity, [])
    else:
        bins = _next_fit(sizes, capacity)
    return _split_until_count(bins, sizes, min_bin_count, bin_count_multiple)


def packing_efficiency(
    bins: Sequence[Sequence[int]], lengths: Sequence[int] | torch.Tensor, capacity: int
) -> float:
    """Real tokens over bin slots: ``sum(lengths in bins) / (len(bins) * capacity)``."""
    sizes = int_list(lengths)
    if not bins:
        return 0.0
    return sum(sizes[i] for b in bins for i in b) / (len(bins) * capacity)


def _check_bin_arguments(
    sizes: list[int], capacity: int, algorithm: str, min_bin_count: int, bin_count_multiple: int
) -> None:
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(_ALGORITHMS)}, got {algorithm!r}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 token, got {capacity}")
    if min_bin_count < 1 or bin_count_multiple < 1:
        raise ValueError(
            f"min_bin_count and bin_count_multiple must be >= 1, got {min_bin_count} and "
            f"{bin_count_multiple}"
        )
    for index, size in enumerate(sizes):
        if size < 0 or size > capacity:
            raise ValueError(
                f"sequence {index} has length {size}, outside [0, capacity={capacity}]; raise the "
                "bin capacity (max_tokens_per_microbatch) to at least the longest sequence or "
                "truncate that sequence"
            )


def _target_count(count: int, min_bin_count: int, bin_count_multiple: int) -> int:
    count = max(count, min_bin_count)
    return -(-count // bin_count_multiple) * bin_count_multiple


def _decreasing(sizes: list[int]) -> list[int]:
    # Stable: equal lengths keep input order, so the result is deterministic.
    return sorted(range(len(sizes)), key=lambda i: -sizes[i])


def _first_fit(
    sizes: list[int], order: list[int], capacity: int, bins: list[list[int]]
) -> list[list[int]]:
    """Put each index into the first bin with room (extending ``bins``), else open a new bin."""
    loads = [sum(sizes[i] for i in b) for b in bins]
    for i in order:
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return bins


def _next_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    load = capacity + 1
    for i, size in enumerate(sizes):
        if load + size > capacity:
            bins.append([])
            load = 0
        bins[-1].append(i)
        load += size
    return bins


def _modified_first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """MFFD (Johnson & Garey, 1985), with items classed by size relative to the capacity C.

    1. every large item (> C/2) opens its own bin, in decreasing order;
    2. forward over those bins: add the largest medium item (C/3, C/2] that fits;
    3. backward over the bins still holding only their large item: if the two smallest small
       items (C/6, C/3] fit together, add the smallest, then the largest small item that fits;
    4. everything left goes first-fit-decreasing over all bins.
    """
    order = _decreasing(sizes)
    large = [i for i in order if 2 * sizes[i] > capacity]
    medium = [i for i in order if 3 * sizes[i] > capacity >= 2 * sizes[i]]
    small = [i for i in order if 6 * sizes[i] > capacity and 3 * sizes[i] <= capacity]
    bins = [[i] for i in large]
    free = [capacity - sizes[i] for i in large]
    for b in range(len(bins)):  # medium are decreasing: the first that fits is the largest
        pick = next((m for m in medium if sizes[m] <= free[b]), None)
        if pick is not None:
            medium.remove(pick)
            bins[b].append(pick)
            free[b] -= sizes[pick]
    for b in reversed(range(len(bins))):
        if len(bins[b]) > 1 or len(small) < 2 or sizes[small[-1]] + sizes[small[-2]] > free[b]:
            continue
        smallest = small.pop()
        bins[b].append(smallest)
        free[b] -= sizes[smallest]
        pick = next(s for s in small if sizes[s] <= free[b])  # exists: the 2nd smallest fits
        small.remove(pick)
        bins[b].append(pick)
        free[b] -= sizes[pick]
    placed = {i for b in bins for i in b}
    return _first_fit(sizes, [i for i in order if i not in placed], capacity, bins)


def _split_until_count(
    bins: list[list[int]], sizes: list[int], min_bin_count: int, bin_count_multiple: int
) -> list[list[int]]:
    target = _target_count(len(bins), min_bin_count, bin_count_multiple)
    if target > len(sizes):
        raise ValueError(
            f"cannot make {target} bins (min_bin_count={min_bin_count}, bin_count_multiple="
            f"{bin_count_multiple}, {len(bins)} bins after packing) from {len(sizes)} sequences: "
            "every bin needs at least one sequence; pass more sequences or lower "
            "min_bin_count/bin_count_multiple"
        )
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        assert splittable, "bin-count target was checked against the number of sequences"
        fullest = max(splittable, key=lambda b: (sum(sizes[i] for i in bins[b]), -b))
        largest = max(range(len(bins[fullest])), key=lambda k: (sizes[bins[fullest][k]], k))
        bins.append([bins[fullest].pop(largest)])
    return bins

"""Head-tail load-balanced context-parallel (CP) sharding of the sequence dimension.

The sequence is cut into ``2 * cp_size`` equal chunks; CP rank ``r`` owns chunks ``r`` and
``2 * cp_size - 1 - r``. Under causal attention the cost of a position grows with its index, so
pairing an early chunk with the mirrored late chunk gives every rank the same amount of work.

Worked example, ``cp_size = 2``, sequence ``[0 1 2 3 4 5 6 7]`` (4 chunks of 2):

    rank 0 owns chunks (0, 3): [0 1 6 7]
    rank 1 owns chunks (1, 2): [2 3 4 5]
    gather_shards([[0 1 6 7], [2 3 4 5]])            -> [0 1 2 3 4 5 6 7]
    load_balanced_to_contiguous(..., cp_rank=1)      -> [4 5 6 7]   (window [r*S/cp, (r+1)*S/cp))

Shape legend: ``S`` full sequence length, ``S/cp`` the local shard length.
All functions are pure: they take ranks and sizes as ints and never mutate their inputs.
"""

from collections.abc import Sequence

import torch

__all__ = [
    "cp_chunk_ids",
    "cp_position_ids",
    "check_cp_seq_len",
    "gather_shards",
    "load_balanced_to_contiguous",
    "shard_for_rank",
]


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1:
        msg = f"cp_size {cp_size} must be >= 1; use 1 to disable context parallelism"
        raise ValueError(msg)
    if not 0 <= cp_rank < cp_size:
        msg = (
            f"cp_rank {cp_rank} must be in [0, cp_size) = [0, {cp_size}); "
            "pass this rank's CP coordinate"
        )
        raise ValueError(msg)


def check_cp_seq_len(seq_len: int, cp_size: int) -> None:
    """Raise unless ``seq_len`` splits into ``2 * cp_size`` equal chunks.

    Raises:
        ValueError: ``seq_len % (2 * cp_size) != 0``; the message names the padding setting.
    """
    if cp_size < 1:
        msg = f"cp_size {cp_size} must be >= 1; use 1 to disable context parallelism"
        raise ValueError(msg)
    if seq_len % (2 * cp_size) != 0:
        msg = (
            f"sequence length {seq_len} must be divisible by 2 * cp_size = {2 * cp_size}; pad it "
            f"(set make_sequence_length_divisible_by to a multiple of {2 * cp_size})"
        )
        raise ValueError(msg)


def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) owned by ``cp_rank``: ``(r, 2*cp_size-1-r)``."""
    _check_rank(cp_rank, cp_size)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_for_rank(x: torch.Tensor, *, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced shard of ``x`` along ``dim``: chunks r and 2*cp_size-1-r.

    Raises:
        ValueError: bad rank/size, or ``x.shape[dim]`` not divisible by ``2 * cp_size``.
    """
    first, second = cp_chunk_ids(cp_rank, cp_size)
    seq_len = x.shape[dim]
    check_cp_seq_len(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    head, tail = x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)
    return torch.cat([head, tail], dim=dim)


def gather_shards(shards: Sequence[torch.Tensor], *, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_for_rank``: the full tensor from every rank's shard (in rank order).

    Raises:
        ValueError: the number of shards is not ``cp_size`` or their lengths differ or are odd.
    """
    if len(shards) != cp_size:
        msg = (
            f"gather_shards got {len(shards)} shards but cp_size is {cp_size}; "
            "pass one shard per CP rank"
        )
        raise ValueError(msg)
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1 or next(iter(lengths)) % 2 != 0:
        msg = (
            f"CP shards must all have the same even length along dim {dim}, got {sorted(lengths)}; "
            "each shard holds two equal chunks (use shard_for_rank)"
        )
        raise ValueError(msg)
    chunk = next(iter(lengths)) // 2
    ordered: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        first, second = cp_chunk_ids(rank, cp_size)
        ordered[first] = shard.narrow(dim, 0, chunk)
        ordered[second] = shard.narrow(dim, chunk, chunk)
    return torch.cat([c for c in ordered if c is not None], dim=dim)


def load_balanced_to_contiguous(
    shards: Sequence[torch.Tensor], *, cp_rank: int, cp_size: int, dim: int = 1
) -> torch.Tensor:
    """The contiguous window ``[r*S/cp, (r+1)*S/cp)`` of the full tensor, from all ranks' shards."""
    _check_rank(cp_rank, cp_size)
    full = gather_shards(shards, cp_size=cp_size, dim=dim)
    width = full.shape[dim] // cp_size
    return full.narrow(dim, cp_rank * width, width)


def cp_position_ids(seq_len: int, *, cp_rank: int, cp_size: int) -> torch.Tensor:
    """int64 ``[S/cp]`` global positions of this rank's shard (cp 2, S 8, rank 0: [0 1 6 7])."""
    positions = torch.arange(seq_len, dtype=torch.int64)
    return shard_for_rank(positions, cp_rank=cp_rank, cp_size=cp_size, dim=0)

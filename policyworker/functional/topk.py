"""Top-k logits: local top-k with global vocab ids, exact merge of per-shard top-k, chunked top-k.

Tie-breaking rule (everywhere in this module): results are ordered by value, largest first, and
among equal values the **lower global vocab id comes first**. Under that total order the global
top-k is a subset of the union of the shards' local top-k, so ``merge_topk`` of per-shard results
is exactly the global result, values and indices, whatever the shard layout. The values always
equal ``torch.topk(logits.float(), k).values`` exactly; ``torch.topk`` itself promises no order
among ties, so its indices may differ only where values tie.

NaN logits are not supported (they have no place in the order above).

Shape legend: ``B`` batch, ``S`` sequence, ``V`` vocab (or local vocab shard), ``K`` k.
All functions are pure: no communication, no device queries, inputs are never mutated.
"""

from collections.abc import Sequence

import torch

from policyworker.functional.logprobs import default_chunk_size
from policyworker.functional.sampling import check_temperature

__all__ = ["local_topk", "merge_topk", "topk_logits"]


def _check_k(k: int) -> None:
    if k < 1:
        msg = f"k {k} must be >= 1 (the number of top logits to return per position)"
        raise ValueError(msg)


# Candidates taken beyond k: enough to hold every id tied with the k-th value in nearly all rows,
# so ties are settled among k + 16 values instead of with a pass over the vocab per row.
_TIE_CANDIDATES = 16


def _topk_lowest_id_on_ties(x_NV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the last dim, ties broken towards the lower index.

    ``torch.topk`` of ``k + _TIE_CANDIDATES`` candidates, ordered by (value desc, id asc); a row
    whose k-th value is above its last candidate's has every id tied with the k-th value among
    them, so its first k are exact. Rows with more ties than that take `_exact_topk` (a pass
    over the vocab)."""
    vocab = x_NV.shape[-1]
    if k == 0:
        empty_ids = torch.empty((*x_NV.shape[:-1], 0), dtype=torch.int64, device=x_NV.device)
        return x_NV.new_empty((*x_NV.shape[:-1], 0)), empty_ids
    taken = min(vocab, k + _TIE_CANDIDATES)
    candidates, ids = torch.topk(x_NV, taken, dim=-1)
    by_id = torch.sort(ids, dim=-1, stable=True)  # ascending ids first ...
    candidates = candidates.gather(-1, by_id.indices)
    # ... then a stable sort by value keeps ascending ids among equal values
    order = torch.sort(candidates, dim=-1, descending=True, stable=True).indices[..., :k]
    values, index = candidates.gather(-1, order), by_id.values.gather(-1, order)
    if taken == vocab:
        return values, index
    settled = values[..., -1] > candidates.amin(dim=-1)
    if bool(settled.all()):
        return values, index
    unsettled = ~settled
    values[unsettled], index[unsettled] = _exact_topk(x_NV[unsettled], k)
    return values, index


def _exact_topk(x_NV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the last dim, ties broken towards the lower index, with a pass over the vocab:
    everything above the k-th value, then the lowest ids equal to it."""
    kth = torch.topk(x_NV, k, dim=-1).values[..., -1:]  # the k-th largest value is tie-independent
    greater = x_NV > kth
    equal = x_NV == kth
    needed = k - greater.sum(dim=-1, keepdim=True)
    selected = greater | (equal & (equal.cumsum(dim=-1) <= needed))  # exactly k per row
    index = selected.nonzero()[:, -1].reshape(*x_NV.shape[:-1], k)  # ascending ids per row
    values = x_NV.gather(-1, index)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), index.gather(-1, order)


def local_topk(
    logits_V: torch.Tensor, k: int, *, vocab_start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values fp32, global ids int64)`` of the ``min(k, V_local)`` largest logits of this shard.

    ``vocab_start`` is the global id of the shard's first column (``vocab_range(rank, ...)[0]``).
    Ordered largest first; equal values by ascending global id.
    """
    _check_k(k)
    x = logits_V.detach().float()
    values, index = _topk_lowest_id_on_ties(x, min(k, x.shape[-1]))
    return values, index + vocab_start


def merge_topk(
    values_list: Sequence[torch.Tensor], indices_list: Sequence[torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k from every shard's ``local_topk`` (e.g. after an all-gather), exact.

    Raises:
        ValueError: the lists differ in length, or there are fewer than ``k`` candidates in total
            (``k`` exceeds the vocab size).
    """
    _check_k(k)
    if len(values_list) != len(indices_list) or not values_list:
        msg = (
            f"merge_topk needs one (values, indices) pair per shard; got {len(values_list)} values "
            f"and {len(indices_list)} indices"
        )
        raise ValueError(msg)
    values = torch.cat(list(values_list), dim=-1)
    indices = torch.cat(list(indices_list), dim=-1)
    if values.shape[-1] < k:
        msg = (
            f"k {k} exceeds the {values.shape[-1]} candidates from all shards (the vocab size); "
            "use k <= vocab size"
        )
        raise ValueError(msg)
    by_id = torch.sort(indices, dim=-1, stable=True).indices  # ascending ids first ...
    values, indices = values.gather(-1, by_id), indices.gather(-1, by_id)
    # ... then a stable sort by value keeps ascending ids among equal values
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return values.gather(-1, order), indices.gather(-1, order)


def topk_logits(
    logits_BSV: torch.Tensor, k: int, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values fp32 [B,S,K], ids int64 [B,S,K])`` of ``logits.float() / T`` at every position.

    No shift: position ``t`` holds the top-k of logits at ``t``. Computed ``chunk_size`` sequence
    positions at a time (default ``default_chunk_size(V)``) so only one fp32 chunk is alive.

    Raises:
        ValueError: ``logits`` is not 3-D, ``k`` is outside ``[1, V]``, temperature <= 0 or
            chunk_size < 1.
    """
    if logits_BSV.dim() != 3:
        msg = f"logits {tuple(logits_BSV.shape)} must be [B, S, V]"
        raise ValueError(msg)
    vocab_size = logits_BSV.shape[-1]
    _check_k(k)
    if k > vocab_size:
        msg = f"k {k} exceeds the vocab size {vocab_size}; use k <= {vocab_size}"
        raise ValueError(msg)
    check_temperature(temperature)
    if chunk_size is not None and chunk_size < 1:
        msg = f"chunk_size {chunk_size} must be >= 1, or None for the default"
        raise ValueError(msg)
    chunk = default_chunk_size(vocab_size) if chunk_size is None else chunk_size
    B, S, _ = logits_BSV.shape
    values = torch.empty((B, S, k), dtype=torch.float32, device=logits_BSV.device)
    indices = torch.empty((B, S, k), dtype=torch.int64, device=logits_BSV.device)
    for start in range(0, S, chunk):
        x = logits_BSV[:, start : start + chunk].detach().float()
        if temperature != 1.0:
            x = x / temperature
        stop = start + chunk
        values[:, start:stop], indices[:, start:stop] = _topk_lowest_id_on_ties(x, k)
    return values, indices

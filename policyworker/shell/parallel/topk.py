"""Top-k of vocab-sharded logits: each rank's local top-k, gathered, then the exact top-k of
the candidates (ties broken towards the lower token id, as on one process)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from policyworker.functional import topk as topk_core
from policyworker.functional import vocab_parallel as vp_core
from policyworker.shell.parallel.groups import _group_size
from policyworker.shell.parallel.vocab_logprobs import _scaled, _vocab_shard_of

__all__ = ["distributed_topk", "topk_any"]


# ----------------------------------------------------------------------------------- top-k

_PAD_ID = 2**62  # id of padding candidates: sorts after every real id among equal (-inf) values


def distributed_topk(
    logits_local: torch.Tensor,
    k: int,
    *,
    tp_group: Any,
    vocab_start: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k over vocab shards: (values fp32 [..., K], global ids int64 [..., K]).

    Per chunk of `chunk_size` positions (dim -2): local top-min(k, V_local) of `logits / T` in
    fp32, all-gather candidates over `tp_group`, merge. Equal to single-process fp32 top-k
    (ties broken towards the lower id). No gradient.

    Raises:
        ValueError: k < 1, or k exceeds the vocab size (after the gather, on every rank alike).
    """
    if k < 1:
        msg = f"k {k} must be >= 1 (the number of top logits to return per position)"
        raise ValueError(msg)
    size = _group_size(tp_group)
    positions = logits_local.shape[-2]
    chunk = chunk_size or max(positions, 1)
    values_out, ids_out = [], []
    with torch.no_grad():
        for start in range(0, positions, chunk):
            x = _scaled(logits_local[..., start : start + chunk, :], temperature)
            values, ids = topk_core.local_topk(x, k, vocab_start=vocab_start)
            missing = k - values.shape[-1]
            if missing:  # a narrow shard: pad so every rank sends k candidates
                values = torch.nn.functional.pad(values, (0, missing), value=float("-inf"))
                ids = torch.nn.functional.pad(ids, (0, missing), value=_PAD_ID)
            all_values = [torch.empty_like(values) for _ in range(size)]
            all_ids = [torch.empty_like(ids) for _ in range(size)]
            if size > 1:
                dist.all_gather(all_values, values.contiguous(), group=tp_group)
                dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
            else:
                all_values, all_ids = [values], [ids]
            merged_values, merged_ids = topk_core.merge_topk(all_values, all_ids, k)
            values_out.append(merged_values)
            ids_out.append(merged_ids)
    values, ids = torch.cat(values_out, dim=-2), torch.cat(ids_out, dim=-2)
    if bool((ids == _PAD_ID).any()):
        msg = f"k {k} exceeds the vocab size of these sharded logits; use k <= vocab size"
        raise ValueError(msg)
    return values, ids


def topk_any(
    logits: torch.Tensor, k: int, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of plain logits (core `topk_logits`) or of vocab-sharded DTensor logits (TP)."""
    if not isinstance(logits, DTensor):
        return topk_core.topk_logits(logits, k, temperature=temperature, chunk_size=chunk_size)
    local, group, tp_rank, tp_size = _vocab_shard_of(logits)
    vocab_size = logits.shape[-1]
    if k > vocab_size:
        msg = f"k {k} exceeds the vocab size {vocab_size}; use k <= {vocab_size}"
        raise ValueError(msg)
    start, _ = vp_core.vocab_range(tp_rank, tp_size, vocab_size)
    return distributed_topk(
        local, k, tp_group=group, vocab_start=start, temperature=temperature, chunk_size=chunk_size
    )

"""Logprobs of vocab-sharded (tensor-parallel) logits without gathering the vocab.

Plain softmax: each rank's partials (max, sum-exp, target logit) from
`policyworker.functional.vocab_parallel` are all-reduced over the TP group. With top-k/top-p the
filters need whole rows, so the rows are exchanged (all-to-all: every rank gets all vocab
shards of `rows / tp` rows), scored there, and gathered back. `*_any` accept plain tensors or
DTensors and pick the right path. Gradients follow `collectives`' convention. The softmax's
entropy (`entropy_any`, inference) reduces its partials the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from policyworker.functional import logprobs as lp_core
from policyworker.functional import vocab_parallel as vp_core
from policyworker.functional.logprob_kernels import EAGER_KERNELS, LogprobKernels
from policyworker.functional.sampling import PLAIN_SAMPLING, Sampling, apply_sampling_filters
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.parallel.groups import _all_reduce

__all__ = [
    "entropy_any",
    "next_token_logprobs_any",
    "target_logprobs_any",
    "vocab_parallel_next_token_logprobs",
    "vocab_parallel_target_logprobs",
]


# --------------------------------------------------------------------- vocab-parallel logprobs


class _VocabParallelTargetLogprobs(torch.autograd.Function):
    """logits [B,S,V_local] (vocab shard) + targets [B,S] -> fp32 [B,S] log p(target)."""

    @staticmethod
    def forward(ctx, logits_BSV, targets_BS, group, vocab_start, temperature, chunk_size):
        num_positions = targets_BS.shape[1]
        out_BS = torch.empty(targets_BS.shape, dtype=torch.float32, device=logits_BSV.device)
        max_BS, sum_exp_BS = torch.empty_like(out_BS), torch.empty_like(out_BS)
        for start in range(0, num_positions, chunk_size):
            stop = min(start + chunk_size, num_positions)
            x = _scaled(logits_BSV[:, start:stop], temperature)
            global_max = _all_reduce(vp_core.local_max(x).contiguous(), dist.ReduceOp.MAX, group)
            sums = torch.stack(
                [
                    vp_core.local_sum_exp(x, global_max),
                    vp_core.local_target_logit(
                        x, targets_BS[:, start:stop], vocab_start=vocab_start
                    ),
                ]
            )
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            out_BS[:, start:stop] = vp_core.logprobs_from_partials(sums[1], global_max, sums[0])
            max_BS[:, start:stop], sum_exp_BS[:, start:stop] = global_max, sums[0]
        ctx.save_for_backward(logits_BSV, targets_BS, max_BS, sum_exp_BS)
        ctx.settings = (vocab_start, temperature, chunk_size)
        return out_BS

    @staticmethod

    # autograd passes one grad per forward output; naming it beats base's *grad_outputs
    def backward(ctx, grad_BS):  # pyright: ignore[reportIncompatibleMethodOverride]
        logits_BSV, targets_BS, max_BS, sum_exp_BS = ctx.saved_tensors
        vocab_start, temperature, chunk_size = ctx.settings
        grad_BSV = torch.zeros_like(logits_BSV)
        for start in range(0, targets_BS.shape[1], chunk_size):
            stop = min(start + chunk_size, targets_BS.shape[1])
            grad = vp_core.local_logprob_grad(
                _scaled(logits_BSV[:, start:stop], temperature),
                targets_BS[:, start:stop],
                vocab_start,
                max_BS[:, start:stop],
                sum_exp_BS[:, start:stop],
                grad_BS[:, start:stop],
            )
            if temperature != 1.0:
                grad = grad / temperature
            grad_BSV[:, start:stop] = grad.to(grad_BSV.dtype)
        return grad_BSV, None, None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return x if temperature == 1.0 else x / temperature


def vocab_parallel_target_logprobs(
    logits_local_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    tp_group: Any,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 [B,S] `log softmax(logits[b,s] / T)[targets[b,s]]` from a vocab shard; differentiable.

    Two all-reduces per chunk of `chunk_size` positions (MAX of the local max; SUM of the local
    sum-exp and target logit), so fp32 memory is one [B, chunk, V_local] block. `tp_group=None`
    means the shard is the whole vocab. Targets outside [0, V) score a meaningless finite value.
    """
    lp_core.check_logits_and_ids(logits_local_BSV, targets_BS)
    chunk = chunk_size or lp_core.default_chunk_size(vocab_size)
    return _VocabParallelTargetLogprobs.apply(
        logits_local_BSV, targets_BS.to(torch.int64), tp_group, vocab_start, temperature, chunk
    )


def vocab_parallel_next_token_logprobs(
    logits_local_BSV: torch.Tensor,
    token_ids_BS: torch.Tensor,
    *,
    tp_group: Any,
    tp_rank: int,
    tp_size: int,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 [B, S-1] next-token logprobs from this rank's vocab shard (layout `vocab_range`).

    Raises:
        ValueError: shapes disagree, or the shard width is not `vocab_range(tp_rank, ...)`'s.
    """
    lp_core.check_logits_and_ids(logits_local_BSV, token_ids_BS)
    start, stop = vp_core.vocab_range(tp_rank, tp_size, vocab_size)
    if logits_local_BSV.shape[-1] != stop - start:
        msg = (
            f"logits shard has {logits_local_BSV.shape[-1]} vocab entries but tp rank {tp_rank} "
            f"of {tp_size} owns [{start}, {stop}) of vocab_size {vocab_size}; shard the vocab as "
            f"torch.chunk does (DTensor Shard(-1))"
        )
        raise ValueError(msg)
    return vocab_parallel_target_logprobs(
        logits_local_BSV[:, :-1],
        token_ids_BS[:, 1:],
        tp_group=tp_group if tp_size > 1 else None,
        vocab_start=start,
        vocab_size=vocab_size,
        temperature=temperature,
        chunk_size=chunk_size,
    )


# --------------------------------------------------------------- top-k / top-p under TP (rows)


class _VocabShardsToRows(torch.autograd.Function):
    """[N, V_local] vocab shard -> [N/tp, V] full rows of this rank (all-to-all); and back."""

    @staticmethod
    def forward(ctx, x_NV, group, tp_rank, tp_size, vocab_size):
        ctx.settings = (group, tp_rank, tp_size, vocab_size)
        width = -(-vocab_size // tp_size)
        send = [_pad_last(p, width) for p in vp_core.split_rows(x_NV, tp_size)]
        recv = [torch.empty_like(send[0]) for _ in range(tp_size)]
        dist.all_to_all(recv, send, group=group)
        widths = [
            b - a for a, b in (vp_core.vocab_range(r, tp_size, vocab_size) for r in range(tp_size))
        ]
        return vp_core.concat_vocab_pieces([p[:, :w] for p, w in zip(recv, widths, strict=True)])

    @staticmethod

    # autograd passes one grad per forward output; naming it beats base's *grad_outputs
    def backward(ctx, grad_rows):  # pyright: ignore[reportIncompatibleMethodOverride]
        group, tp_rank, tp_size, vocab_size = ctx.settings
        width = -(-vocab_size // tp_size)
        send = [_pad_last(p, width) for p in vp_core.split_vocab(grad_rows.contiguous(), tp_size)]
        recv = [torch.empty_like(send[0]) for _ in range(tp_size)]
        dist.all_to_all(recv, send, group=group)
        start, stop = vp_core.vocab_range(tp_rank, tp_size, vocab_size)
        return torch.cat(recv, dim=0)[:, : stop - start], None, None, None, None


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    # gloo's all_to_all needs equal-sized pieces; the last vocab shard may be narrower.
    if x.shape[-1] == width:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()


class _GatherRows(torch.autograd.Function):
    """[N/tp] rows of this rank -> [N] all rows (all-gather); backward keeps this rank's rows."""

    @staticmethod
    def forward(ctx, rows_N, group, tp_rank, tp_size):
        ctx.settings = (tp_rank, rows_N.shape[0])
        parts = [torch.empty_like(rows_N) for _ in range(tp_size)]
        dist.all_gather(parts, rows_N.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod

    # autograd passes one grad per forward output; naming it beats base's *grad_outputs
    def backward(ctx, grad_N):  # pyright: ignore[reportIncompatibleMethodOverride]
        tp_rank, num_rows = ctx.settings
        return grad_N[tp_rank * num_rows : (tp_rank + 1) * num_rows], None, None, None


def _filtered_row_logprobs(rows_NV, targets_N, *, sampling, chunk_size):
    out = []
    for start in range(0, rows_NV.shape[0], chunk_size):
        x = _scaled(rows_NV[start : start + chunk_size], sampling.temperature)
        x = apply_sampling_filters(x, top_k=sampling.top_k, top_p=sampling.top_p)
        index = targets_N[start : start + chunk_size, None].clamp(0, x.shape[-1] - 1)
        out.append(torch.log_softmax(x, dim=-1).gather(-1, index)[:, 0].float())
    return torch.cat(out) if out else rows_NV.new_zeros(0, dtype=torch.float32)


def _tp_filtered_target_logprobs(
    logits_local_BSV,
    targets_BS,
    *,
    group,
    tp_rank,
    tp_size,
    vocab_size,
    sampling,
    chunk_size,
):
    batch, seq, _ = logits_local_BSV.shape
    row_start, row_stop = vp_core.rows_for_rank(batch * seq, tp_rank, tp_size)
    rows = _VocabShardsToRows.apply(
        logits_local_BSV.reshape(batch * seq, -1), group, tp_rank, tp_size, vocab_size
    )
    targets = targets_BS.reshape(-1)[row_start:row_stop].to(torch.int64)
    chunk = chunk_size or lp_core.default_chunk_size(vocab_size)
    mine = _filtered_row_logprobs(rows, targets, sampling=sampling, chunk_size=chunk)
    return _GatherRows.apply(mine, group, tp_rank, tp_size).reshape(batch, seq)


def _vocab_shard_of(logits: DTensor) -> tuple[torch.Tensor, Any, int, int]:
    """(local tensor, tp group, tp rank, tp size) of logits sharded on the vocab dim."""
    mesh, placements = logits.device_mesh, logits.placements
    vocab_dim = logits.ndim - 1
    if mesh.ndim != 1 or not (
        isinstance(placements[0], Shard) and placements[0].dim in (-1, vocab_dim)
    ):
        msg = (
            f"DTensor logits must be sharded on the vocab dim over a 1-D tp mesh, got placements "
            f"{placements} on a {mesh.ndim}-D mesh; use the vocab-parallel lm_head plan"
        )
        raise ValueError(msg)
    return logits.to_local(), mesh.get_group(), mesh.get_local_rank(), mesh.size()


def target_logprobs_any(
    logits: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    sampling: Sampling = PLAIN_SAMPLING,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 [B,S] `log softmax(filter(logits / T))[targets]` per position; plain or TP logits.

    A plain tensor holds the whole vocab; a DTensor sharded on the vocab dim (TP lm_head) is
    scored with vocab-parallel partials, or, with top-k/top-p, redistributed to full rows
    (`B*S % tp == 0` required), filtered there and gathered back. Differentiable.
    """
    lp_core.check_logits_and_ids(logits, targets_BS)
    vocab_size = logits.shape[-1]
    if not isinstance(logits, DTensor):
        if sampling.filters_active:
            rows = _filtered_row_logprobs(
                logits.reshape(-1, vocab_size),
                targets_BS.reshape(-1).to(torch.int64),
                sampling=sampling,
                chunk_size=chunk_size or lp_core.default_chunk_size(vocab_size),
            )
            return rows.reshape(targets_BS.shape)
        return vocab_parallel_target_logprobs(
            logits,
            targets_BS,
            tp_group=None,
            vocab_start=0,
            vocab_size=vocab_size,
            temperature=sampling.temperature,
            chunk_size=chunk_size,
        )
    local, group, tp_rank, tp_size = _vocab_shard_of(logits)
    if sampling.filters_active:
        return _tp_filtered_target_logprobs(
            local,
            targets_BS,
            group=group,
            tp_rank=tp_rank,
            tp_size=tp_size,
            vocab_size=vocab_size,
            sampling=sampling,
            chunk_size=chunk_size,
        )
    start, _ = vp_core.vocab_range(tp_rank, tp_size, vocab_size)
    return vocab_parallel_target_logprobs(
        local,
        targets_BS,
        tp_group=group,
        vocab_start=start,
        vocab_size=vocab_size,
        temperature=sampling.temperature,
        chunk_size=chunk_size,
    )


def next_token_logprobs_any(
    logits: torch.Tensor,
    token_ids_BS: torch.Tensor,
    ctx: ParallelContext | None = None,
    *,
    sampling: Sampling = PLAIN_SAMPLING,
    chunk_size: int | None = None,
    kernels: LogprobKernels = EAGER_KERNELS,
) -> torch.Tensor:
    """fp32 [B, S-1] next-token logprobs of plain logits (core) or TP vocab-sharded DTensor logits.

    `kernels` score plain logits (the vocab-sharded path has its own partials).

    Raises:
        ValueError: shapes disagree; under TP with top-k/top-p, `B*S` not divisible by tp
            (fix: `make_sequence_length_divisible_by`); DTensor logits not on `ctx`'s tp mesh.
    """
    lp_core.check_logits_and_ids(logits, token_ids_BS)
    if not isinstance(logits, DTensor):
        return lp_core.next_token_logprobs(
            logits,
            token_ids_BS,
            sampling=sampling,
            chunk_size=chunk_size,
            kernels=kernels,
        )
    if ctx is not None and logits.device_mesh.size() != ctx.tp_size:
        msg = (
            f"DTensor logits live on a mesh of size {logits.device_mesh.size()} but "
            f"tensor_parallel_size is {ctx.tp_size}; pass the ParallelContext the model was "
            f"built with"
        )
        raise ValueError(msg)
    if sampling.filters_active:
        # Rows are whole positions, so score all S positions (B*S % tp rule) and drop the last.
        targets = lp_core.shifted_targets(token_ids_BS, pad_id=0)
        full = target_logprobs_any(
            logits,
            targets,
            sampling=sampling,
            chunk_size=chunk_size,
        )
        return full[:, :-1]
    local, group, tp_rank, tp_size = _vocab_shard_of(logits)
    return vocab_parallel_next_token_logprobs(
        local,
        token_ids_BS,
        tp_group=group,
        tp_rank=tp_rank,
        tp_size=tp_size,
        vocab_size=logits.shape[-1],
        temperature=sampling.temperature,
        chunk_size=chunk_size,
    )


def entropy_any(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    kernels: LogprobKernels = EAGER_KERNELS,
) -> torch.Tensor:
    """fp32 [B, S] entropy of `softmax(logits / T)` at every position (no shift, no filters) of
    plain logits (core `token_entropy` with `kernels`) or vocab-sharded DTensor logits: per
    chunk of positions, all-reduce MAX of the local max, then SUM of the two local partials.
    For inference: no gradient flows through the all-reduces."""
    if not isinstance(logits, DTensor):
        return lp_core.token_entropy(
            logits, temperature=temperature, chunk_size=chunk_size, kernels=kernels
        )
    local, group, _, _ = _vocab_shard_of(logits)
    chunk = chunk_size or lp_core.default_chunk_size(logits.shape[-1])
    parts = [local.new_zeros((local.shape[0], 0), dtype=torch.float32)]
    for start in range(0, local.shape[1], chunk):
        x = _scaled(local[:, start : start + chunk].detach(), temperature)
        global_max = _all_reduce(vp_core.local_max(x).contiguous(), dist.ReduceOp.MAX, group)
        sums = torch.stack(
            [vp_core.local_sum_exp(x, global_max), vp_core.local_sum_exp_centered(x, global_max)]
        )
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        parts.append(vp_core.entropy_from_partials(sums[0], sums[1]).float())
    return torch.cat(parts, dim=1)

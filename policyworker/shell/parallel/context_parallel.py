"""Context parallelism: the sequence split over CP ranks (load-balanced chunks), the forward
over this rank's chunk, and logprobs / gathers over the whole sequence."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from policyworker.functional import context_parallel as cp_core
from policyworker.functional import logprobs as lp_core
from policyworker.functional.sampling import PLAIN_SAMPLING, Sampling
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.parallel.vocab_logprobs import target_logprobs_any

__all__ = ["all_gather_cp", "context_parallel_forward", "cp_next_token_logprobs"]


# ------------------------------------------------------------------------------- CP gather


class _AllGatherCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, cp_rank, cp_size, dim):
        ctx.settings = (group, cp_rank, cp_size, dim)
        parts = [torch.empty_like(shard) for _ in range(cp_size)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return cp_core.gather_shards(parts, cp_size=cp_size, dim=dim)

    @staticmethod

    # autograd passes one grad per forward output; naming it beats base's *grad_outputs
    def backward(ctx, grad_full):  # pyright: ignore[reportIncompatibleMethodOverride]
        group, cp_rank, cp_size, dim = ctx.settings
        grad = grad_full.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return (
            cp_core.shard_for_rank(grad, cp_rank=cp_rank, cp_size=cp_size, dim=dim),
            None,
            None,
            None,
            None,
        )


def all_gather_cp(
    shard: torch.Tensor, *, cp_group: Any, cp_size: int, dim: int = 1
) -> torch.Tensor:
    """Head-tail CP shards [.., S/cp, ..] -> the full sequence in original order (differentiable).

    Backward: all-reduce the gradient over CP (SUM), keep this rank's chunks.
    """
    if cp_size == 1:
        return shard
    cp_rank = dist.get_rank(cp_group)
    return _AllGatherCP.apply(shard, cp_group, cp_rank, cp_size, dim)


def _no_attention_mask(config: Any) -> dict[str, None]:
    # A per-layer-type mask mapping of None stops HF from building a mask: torch's CP attention
    # needs sdpa with is_causal=True and no mask (a mask would need a DTensor redistribution).
    layer_types = getattr(config, "layer_types", None) or ("full_attention",)
    return dict.fromkeys(set(layer_types) | {"full_attention"}, None)


def context_parallel_forward(
    model: torch.nn.Module,
    ctx: ParallelContext,
    input_ids_BS: torch.Tensor,
    position_ids_BS: torch.Tensor,
) -> torch.Tensor:
    """Forward under torch's context-parallel attention; logits of this CP rank's head-tail shard.

    Returns [B, S/cp, V] (or a vocab-sharded DTensor under TP) in `shard_for_rank` order.

    Raises:
        ValueError: not on CUDA (torch has no CPU kernel for context-parallel attention), or S
            not divisible by 2 * cp_size.
    """
    if input_ids_BS.device.type != "cuda":
        msg = (
            f"context parallelism needs CUDA: torch has no CPU kernel for context-parallel "
            f"attention (input_ids are on {input_ids_BS.device.type!r}); set "
            f"context_parallel_size to 1"
        )
        raise ValueError(msg)
    cp_core.check_cp_seq_len(input_ids_BS.shape[1], ctx.cp_size)
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if ctx.mesh is None:
        msg = (
            "context parallelism needs a device mesh over ('dp', 'cp', 'tp'), but the parallel "
            "context has none (no process group); initialise torch.distributed first or set "
            "context_parallel_size to 1"
        )
        raise ValueError(msg)
    ids, positions = input_ids_BS.clone(), position_ids_BS.clone()
    with (
        context_parallel(
            ctx.mesh["cp"],
            buffers=[ids, positions],
            buffer_seq_dims=[1, 1],
            no_restore_buffers={ids, positions},
        ),
        sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        ),
    ):
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=_no_attention_mask(model.config),
            use_cache=False,
        )
    return out.logits


def cp_next_token_logprobs(
    logits_local: torch.Tensor,
    token_ids_BS: torch.Tensor,
    ctx: ParallelContext,
    *,
    sampling: Sampling = PLAIN_SAMPLING,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 [B, S-1] on every CP rank from this rank's head-tail logits shard (full token_ids)."""
    targets = cp_core.shard_for_rank(
        lp_core.shifted_targets(token_ids_BS, pad_id=0), cp_rank=ctx.cp_rank, cp_size=ctx.cp_size
    )
    local = target_logprobs_any(logits_local, targets, sampling=sampling, chunk_size=chunk_size)
    return all_gather_cp(local, cp_group=ctx.groups.get("cp"), cp_size=ctx.cp_size)[:, :-1]

"""Gradient norm and clipping over sharded parameters: each DTensor's squared norm is reduced
over the mesh dims it is sharded on, so the total is the single-process norm."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from policyworker.shell.parallel.context import ParallelContext

__all__ = ["clip_grads_", "total_grad_norm"]


# ------------------------------------------------------------------------------- grad norm


def _reduce_groups(grad: torch.Tensor) -> tuple[tuple[Any, ...], torch.Tensor]:
    """(groups to SUM the squared norm over, local shard) of one gradient."""
    if not isinstance(grad, DTensor):
        return (), grad
    placements = grad.placements
    if any(isinstance(p, Partial) for p in placements):
        placements = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        grad = grad.redistribute(placements=placements)
    mesh = grad.device_mesh
    # FSDP2 over TP shards dp with _StridedShard, which is neither a Shard nor is_shard().
    sharded = (Shard, _StridedShard)
    groups = tuple(
        mesh.get_group(d)
        for d, p in enumerate(placements)
        if isinstance(p, sharded) and mesh.size(d) > 1
    )
    return groups, grad.to_local()


def total_grad_norm(parameters: Iterable[torch.nn.Parameter], ctx: ParallelContext) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32, 0-d, on the grads' device), sharding-aware.

    Squares are summed over each gradient's local shard, then all-reduced over every mesh dim on
    which it is sharded (Replicate dims are not double counted; Partial grads are reduced first).
    Every rank must pass the same parameters in the same order.

    Each shard's norm comes from `torch._foreach_norm` (in fp32 for any gradient dtype, a few
    multi-tensor kernels for all gradients, as torch's own `get_total_norm`); they are squared
    and summed in float64. One kernel chain per gradient in float64 (the former way) read and
    wrote every gradient several times over and launched ~4 kernels per parameter.
    """
    locals_by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[torch.Tensor]]] = {}
    device = ctx.device
    for param in parameters:
        if param.grad is None:
            continue
        groups, local = _reduce_groups(param.grad)
        key = tuple(id(g) for g in groups)
        locals_by_groups.setdefault(key, (groups, []))[1].append(local.detach())
        device = local.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for groups, grads in locals_by_groups.values():
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # pyright: ignore[reportPrivateImportUsage]
        square_sum = torch.stack([n.to(grads[0].device) for n in norms]).double().pow(2).sum()
        for group in groups:
            dist.all_reduce(square_sum, op=dist.ReduceOp.SUM, group=group)
        total = total + square_sum.to(device)
    return total.sqrt().float()


def clip_grads_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor
) -> torch.Tensor:
    """Scale every gradient by `min(1, max_norm / (total_norm + 1e-6))` in place.

    A non-finite `total_norm` leaves the gradients untouched (the caller skips the step).
    Returns `total_norm` (the pre-clip norm).
    """
    norm = float(total_norm)
    if not math.isfinite(norm):
        return total_norm
    coef = min(1.0, max_norm / (norm + 1e-6))
    grads = [
        p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        for p in parameters
        if p.grad is not None
    ]
    if coef < 1.0 and grads:  # one multi-tensor kernel per device and dtype
        torch._foreach_mul_(grads, coef)  # pyright: ignore[reportPrivateImportUsage]
    return total_norm

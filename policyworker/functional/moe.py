"""MoE routing math: the aux-loss-free gate-bias update and router replay (R3).

Gate-bias update (DeepSeek-V3's auxiliary-loss-free balancing; NeMo-RL's
`moe_router_bias_update_rate`): after each optimizer step every expert's selection bias moves by
`rate` toward balance, up when the expert got fewer tokens than the mean, down when more.

Router replay: the rollout engine records the experts it chose per token and layer
(`routed_experts` [B, S, layers, top_k]; a row of all -1 means "no recorded route", and that token
keeps the model's own choice). Training and logprobs force those experts; the gate weights are
recomputed from the router's own logits at the forced experts, so gradients reach the router as
they would have for its own choice.

Shape legend: ``N`` tokens, ``E`` experts, ``K`` experts per token (top_k), ``L`` layers.
All functions are pure: no communication, no device queries, inputs are never mutated.
"""

from collections.abc import Sequence
from typing import Literal

import torch
from attrs import frozen

__all__ = [
    "MISSING_ROUTE",
    "RouterRule",
    "balancing_bias_update",
    "effective_routes",
    "gate_weights_at",
    "payload_layers",
    "route_problem",
]

# NeMo-RL's sentinel: a token's route row of all -1 was not recorded by the rollout engine.
MISSING_ROUTE = -1


def balancing_bias_update(expert_load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """fp32 change of each expert's selection bias: ``rate * sign(mean load - load)``.

    ``expert_load_E`` holds integer token counts (the last dim is the experts; leading dims are
    independent routers). The comparison with the mean is exact: ``E * load`` against the total,
    in integers, so an expert exactly at the mean never moves.
    """
    if rate < 0:
        msg = f"rate {rate} must be >= 0 (the bias step per optimizer step; 0 disables it)"
        raise ValueError(msg)
    if expert_load_E.is_floating_point() or expert_load_E.is_complex():
        msg = f"expert_load_E must hold integer token counts, got dtype {expert_load_E.dtype}"
        raise ValueError(msg)
    load = expert_load_E.to(torch.int64)
    num_experts = load.shape[-1]
    total = load.sum(dim=-1, keepdim=True)
    direction = torch.sign(total - num_experts * load)
    return direction.to(torch.float32) * rate


@frozen(kw_only=True)
class RouterRule:
    """How one router family turns its logits into the gate weights of chosen experts.

    `scoring` is the per-expert score (softmax over experts, or an independent sigmoid);
    `upcast_before_softmax` casts the logits to fp32 before a softmax (Mixtral) instead of asking
    softmax for an fp32 result (Qwen3-MoE); `normalize` divides the chosen scores by their sum
    plus `norm_epsilon`; `scaling` multiplies the result when `scale` is set (DeepSeek-V3);
    `cast_to_logits_dtype` casts the weights back to the logits' dtype (Qwen3-MoE). Following the
    model's own order of operations keeps replayed weights bitwise equal to the router's own.
    """

    scoring: Literal["softmax", "sigmoid"]
    normalize: bool
    norm_epsilon: float = 0.0
    scale: bool = False
    scaling: float = 1.0
    upcast_before_softmax: bool = False
    cast_to_logits_dtype: bool = False


def gate_weights_at(
    router_logits_NE: torch.Tensor, experts_NK: torch.Tensor, rule: RouterRule
) -> torch.Tensor:
    """Gate weights [N, K] of the experts ``experts_NK`` under ``rule`` (differentiable in the
    logits). At the router's own top-k experts this is the router's own weights."""
    logits = router_logits_NE
    if rule.scoring == "sigmoid":
        scores = logits.sigmoid()
    elif rule.upcast_before_softmax:
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = scores.gather(1, experts_NK.to(torch.int64))
    if rule.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.norm_epsilon)
    if rule.scale:
        weights = weights * rule.scaling
    if rule.cast_to_logits_dtype:
        weights = weights.to(logits.dtype)
    return weights


def effective_routes(own_NK: torch.Tensor, recorded_NK: torch.Tensor) -> torch.Tensor:
    """The experts each token uses: the recorded row, or the router's own where the recorded
    row is all ``MISSING_ROUTE``. Same dtype as ``own_NK``."""
    if own_NK.shape != recorded_NK.shape:
        msg = (
            f"recorded routes have shape {tuple(recorded_NK.shape)} but the router chose "
            f"{tuple(own_NK.shape)}; they must match [tokens, top_k]"
        )
        raise ValueError(msg)
    recorded = recorded_NK.to(device=own_NK.device, dtype=own_NK.dtype)
    missing_N1 = (recorded == MISSING_ROUTE).all(dim=-1, keepdim=True)
    return torch.where(missing_N1, own_NK, recorded)


def route_problem(routes: torch.Tensor, *, num_experts: int) -> str | None:
    """Why ``routes`` [..., K] cannot be replayed (first problem found), or None when it can.

    Every row is either all ``MISSING_ROUTE`` or K distinct expert ids in [0, num_experts).
    """
    if routes.is_floating_point() or routes.dtype == torch.bool or routes.is_complex():
        return f"dtype {routes.dtype} is not an integer dtype"
    if routes.numel() == 0:
        return None
    missing = (routes == MISSING_ROUTE).all(dim=-1, keepdim=True)
    bad = ~missing & ((routes < 0) | (routes >= num_experts))
    if bool(bad.any()):
        value = int(routes[bad][0])
        if value < 0:
            return (
                f"holds {value} in a row that is not all {MISSING_ROUTE} (a missing route "
                f"must be a whole row of {MISSING_ROUTE})"
            )
        return f"holds expert id {value}, outside [0, {num_experts})"
    ordered = routes.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & ~missing
    if bool(repeated.any()):
        return "repeats an expert within one token's route (top-k experts are distinct)"
    return None


def payload_layers(
    moe_layers: Sequence[int], *, num_payload_layers: int, num_layers: int
) -> list[int] | None:
    """For each MoE layer (decoder layer numbers, ascending), its index on the layers axis of
    ``routed_experts``: the axis lists either only the MoE layers, in order, or every decoder
    layer (vLLM's layout). None when the axis length fits neither."""
    if num_payload_layers == len(moe_layers):
        return list(range(len(moe_layers)))
    if num_payload_layers == num_layers:
        return list(moe_layers)
    return None

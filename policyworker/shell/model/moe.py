"""MoE routers of the live model: expert-load counting for the gate-bias update, router replay.

One forward hook per router (`<decoder layer>.mlp.gate` of Qwen3-MoE, Mixtral, DeepSeek-V3: each
returns `(router_logits, gate_weights, expert_ids)` for the flattened tokens). The worker tells
this object about each microbatch (`begin_microbatch`) and opens scopes:

- `replaying(enabled)`: while open, each router's expert choice is replaced by the microbatch's
  `routed_experts` (all -1 rows keep the router's choice) and its gate weights are recomputed from
  its own logits at those experts (`functional.moe.gate_weights_at`).
- `counting(enabled)`: while open, the experts each real token used (after replay) are counted per
  router; a microbatch's counts replace any earlier ones of the same microbatch, so activation
  checkpointing's recompute in backward does not count twice. `finish_step` sums the step's counts
  over the dp x cp ranks and moves each `e_score_correction_bias` (fp32) by
  `dtensor_cfg.moe_router_bias_update_rate` toward balance (`functional.moe.balancing_bias_update`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from policyworker.functional.moe import (
    RouterRule,
    balancing_bias_update,
    effective_routes,
    gate_weights_at,
    payload_layers,
    route_problem,
)
from policyworker.functional.packing import pack
from policyworker.functional.padding import mask_from_lengths

__all__ = ["ROUTED_EXPERTS_KEY", "MoeRouting", "router_rule"]

log = logging.getLogger(__name__)
ROUTED_EXPERTS_KEY = "routed_experts"
_GATE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
_BIAS = "e_score_correction_bias"


def router_rule(config: Any) -> RouterRule | None:
    """How this HF config's routers weight their chosen experts; None for an unsupported type."""
    model_type = getattr(config, "model_type", None)
    if model_type == "deepseek_v3":
        return RouterRule(
            scoring="sigmoid",
            normalize=bool(config.norm_topk_prob),
            norm_epsilon=1e-20,
            scale=True,
            scaling=float(config.routed_scaling_factor),
        )
    if model_type == "qwen3_moe":
        return RouterRule(
            scoring="softmax", normalize=bool(config.norm_topk_prob), cast_to_logits_dtype=True
        )
    if model_type == "mixtral":
        return RouterRule(scoring="softmax", normalize=True, upcast_before_softmax=True)
    return None


_REPLAY_MODEL_TYPES = ("deepseek_v3", "mixtral", "qwen3_moe")


class _Router:
    """One MoE router: its decoder layer, its module and (DeepSeek-V3) its bias buffer."""

    def __init__(self, name: str, layer: int, module: nn.Module) -> None:
        self.name = name
        self.layer = layer
        self.module = module
        gate: Any = module  # HF router: `weight` [experts, hidden] and `top_k`
        self.num_experts = int(gate.weight.shape[0])
        self.top_k = int(gate.top_k)

    @property
    def bias(self) -> torch.Tensor | None:
        """The live buffer (looked up each time: moving the model replaces buffer tensors)."""
        return getattr(self.module, _BIAS, None)


class MoeRouting:
    """The routers of `model`, hooked for counting and replay as `cfg` asks (else inert)."""

    def __init__(self, model: nn.Module, cfg: Any, parallel: Any) -> None:
        self.parallel = parallel
        self.config: Any = model.config
        self.rate = float(cfg.dtensor_cfg.moe_router_bias_update_rate)
        self.replay_enabled = cfg.router_replay is not None
        self.routers = _find_routers(model)
        self.rule = router_rule(self.config)
        model_type = getattr(self.config, "model_type", None)
        if self.replay_enabled and (not self.routers or model_type not in _REPLAY_MODEL_TYPES):
            msg = (
                f"router_replay is enabled but model_type {model_type!r} is not supported for "
                f"router replay (supported: {', '.join(_REPLAY_MODEL_TYPES)}); remove "
                f"policy.router_replay or set enabled: false"
            )
            raise ValueError(msg)
        if self.replay_enabled and (parallel.cp_size > 1 or parallel.tp_size > 1):
            msg = (
                f"router_replay needs each rank to route whole sequences; got "
                f"context_parallel_size={parallel.cp_size}, tensor_parallel_size="
                f"{parallel.tp_size}; set both to 1 or disable router_replay"
            )
            raise ValueError(msg)
        self.biased = [r for r in self.routers if r.bias is not None] if self.rate > 0 else []
        if self.rate > 0 and not self.biased:
            log.warning(
                "dtensor_cfg.moe_router_bias_update_rate=%s has no effect: model_type %r "
                "has no router with %s (only DeepSeek-V3-style routers have one)",
                self.rate,
                model_type,
                _BIAS,
            )
        self._replaying = False
        self._counting = False
        self._routes_NLK: torch.Tensor | None = None
        self._payload: list[int] = []
        self._valid_N: torch.Tensor | None = None
        self._is_dummy = False
        self._pending: dict[int, torch.Tensor] = {}
        self._step_load: dict[int, torch.Tensor] = {}
        self.last_step_load: dict[str, torch.Tensor] = {}
        self._handles = []
        if self.replay_enabled or self.biased:
            for index, router in enumerate(self.routers):
                self._handles.append(
                    router.module.register_forward_hook(self._hook_for(index, router))
                )

    # ------------------------------------------------------------------------------ data

    def check_replay_data(self, data: Mapping[str, Any], *, require: bool = True) -> None:
        """Raise ValueError naming `routed_experts` when replay is on and its data is unusable."""
        if not (self.replay_enabled and require):
            return
        key = ROUTED_EXPERTS_KEY
        if key not in data:
            msg = (
                f"router_replay is enabled and require_router_replay=True but data has no "
                f"{key!r} [B, S, layers, top_k]; add the rollout engine's routes or pass "
                f"require_router_replay=False"
            )
            raise ValueError(msg)
        routes = data[key]
        ids = data["input_ids"]
        num_layers = int(self.config.num_hidden_layers)
        moe_layers = [r.layer for r in self.routers]
        top_k = self.routers[0].top_k
        expected = (
            f"[B, S, layers, top_k] = [{ids.shape[0]}, {ids.shape[1]}, "
            f"{len(moe_layers)} MoE layers or {num_layers} layers, {top_k}]"
        )
        if not isinstance(routes, torch.Tensor) or routes.ndim != 4:
            got = tuple(routes.shape) if isinstance(routes, torch.Tensor) else type(routes).__name__
            msg = f"data[{key!r}] must be a tensor {expected}, got {got}"
            raise ValueError(msg)
        layers = payload_layers(
            moe_layers, num_payload_layers=routes.shape[2], num_layers=num_layers
        )
        if (
            tuple(routes.shape[:2]) != tuple(ids.shape)
            or routes.shape[3] != top_k
            or (layers is None)
        ):
            msg = f"data[{key!r}] has shape {tuple(routes.shape)}; it must be {expected}"
            raise ValueError(msg)
        problem = route_problem(routes, num_experts=self.routers[0].num_experts)
        if problem is not None:
            msg = (
                f"data[{key!r}] {problem}; send the rollout engine's expert ids per token and "
                f"layer, with a row of -1 where no route was recorded"
            )
            raise ValueError(msg)

    def begin_microbatch(self, mb: Any) -> None:
        """Hold microbatch `mb`'s flattened routes and real-token mask for the routers' hooks."""
        if not self._handles:
            return
        self._commit_pending()
        self._is_dummy = mb.is_dummy
        if mb.packed:
            self._valid_N = torch.ones(int(mb.lengths.sum()), dtype=torch.bool)
        else:
            self._valid_N = mask_from_lengths(mb.lengths.cpu(), mb.width).reshape(-1)
        self._valid_N = self._valid_N.to(mb.input_ids.device)
        routes = mb.data.get(ROUTED_EXPERTS_KEY) if self.replay_enabled else None
        self._routes_NLK = None
        if isinstance(routes, torch.Tensor):
            routes = pack(routes, mb.lengths.to(routes.device))[0] if mb.packed else routes
            self._routes_NLK = routes.reshape(-1, *routes.shape[-2:])
            self._payload = (
                payload_layers(
                    [r.layer for r in self.routers],
                    num_payload_layers=routes.shape[-2],
                    num_layers=int(self.config.num_hidden_layers),
                )
                or []
            )

    # ------------------------------------------------------------------------------ scopes

    @contextlib.contextmanager
    def replaying(self, enabled: bool = True) -> Iterator[None]:
        """Force the recorded routes inside (when router replay is configured and `enabled`)."""
        previous = self._replaying
        self._replaying = bool(enabled) and self.replay_enabled
        try:
            yield
        finally:
            self._replaying = previous
            self._routes_NLK = None

    @contextlib.contextmanager
    def counting(self, enabled: bool = True) -> Iterator[None]:
        """Count expert loads inside (when a bias update is configured and `enabled`)."""
        self._counting = bool(enabled) and bool(self.biased)
        self._pending.clear()
        self._step_load.clear()
        try:
            yield
        finally:
            self._counting = False
            self._pending.clear()
            self._step_load.clear()

    def finish_step(self, *, applied: bool) -> None:
        """After an optimizer step (`applied`) move the biases by the step's global loads; a
        skipped step drops its counts. Collective over dp x cp when a bias update is on."""
        if not self._counting:
            return
        self._commit_pending()
        if not applied:
            self._step_load.clear()
            return
        device = self.parallel._collective_device()
        load_RE = torch.stack(
            [
                self._step_load.get(i, torch.zeros(r.num_experts, dtype=torch.int64)).to(device)
                for i, r in enumerate(self.biased)
            ]
        )
        self.parallel.all_reduce(load_RE, axis="dp_cp")
        self._step_load.clear()
        delta_RE = balancing_bias_update(load_RE, self.rate)
        with torch.no_grad():
            for router, load, delta in zip(self.biased, load_RE, delta_RE, strict=True):
                bias = router.bias
                assert bias is not None  # `biased` holds routers with a bias only
                bias.add_(delta.to(bias.device, bias.dtype))
                self.last_step_load[router.name] = load.cpu()

    # ------------------------------------------------------------------------------ hooks

    def _commit_pending(self) -> None:
        for index, load in self._pending.items():
            self._step_load[index] = self._step_load.get(index, 0) + load
        self._pending.clear()

    def _hook_for(self, index: int, router: _Router):
        bias_index = next((i for i, r in enumerate(self.biased) if r is router), None)

        def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
            logits, weights, experts = output
            if self._replaying and self._routes_NLK is not None:
                experts, weights = self._replay(index, logits, weights, experts)
                output = (logits, weights, experts)
            if (
                self._counting
                and bias_index is not None
                and not self._is_dummy
                and (torch.is_grad_enabled())
            ):
                self._pending[bias_index] = self._count(router, experts)
            return output

        return hook

    def _tokens_check(self, what: str, num_tokens: int, expected: int) -> None:
        if num_tokens != expected:
            msg = (
                f"a router saw {num_tokens} tokens but the microbatch has {expected} ({what}); "
                f"MoE routing features need whole, unsharded sequences on each rank"
            )
            raise ValueError(msg)

    def _replay(self, index, logits, weights, experts):
        routes_NLK, rule = self._routes_NLK, self.rule
        assert routes_NLK is not None and rule is not None  # replay runs only with both
        recorded_NK = routes_NLK[:, self._payload[index]]
        self._tokens_check("routed_experts", experts.shape[0], recorded_NK.shape[0])
        forced = effective_routes(experts, recorded_NK)
        if torch.equal(forced, experts):
            return experts, weights
        return forced, gate_weights_at(logits, forced, rule).to(weights.dtype)

    def _count(self, router: _Router, experts_NK: torch.Tensor) -> torch.Tensor:
        valid_N = self._valid_N
        assert valid_N is not None  # set by begin_microbatch before any forward
        self._tokens_check("input_lengths", experts_NK.shape[0], valid_N.numel())
        used = experts_NK[valid_N.to(experts_NK.device)].reshape(-1)
        return torch.bincount(used.detach().cpu(), minlength=router.num_experts)


def _find_routers(model: nn.Module) -> list[_Router]:
    """The MoE routers (`layers.<i>.mlp.gate` modules with a `top_k`), by decoder layer."""
    routers = []
    for name, module in model.named_modules():
        match = _GATE_NAME.search(name)
        if match and hasattr(module, "top_k") and hasattr(module, "weight"):
            routers.append(_Router(name, int(match.group(1)), module))
    return sorted(routers, key=lambda r: r.layer)

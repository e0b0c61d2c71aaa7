"""FP8 training of the decoder layers' linears through torchao (`dtensor_cfg.fp8`).

`apply_float8_training(model, fp8_cfg, device=..., tp_size=...)` runs after LoRA injection and
before FSDP2 and the layer compile:

- plain `nn.Linear`s inside the decoder layers become torchao `Float8Linear`s
  (`convert_to_float8_training`). `Float8Linear` subclasses `nn.Linear` and takes over the
  module's own `weight` / `bias` Parameters, so state-dict names, dtypes (fp32 master weights),
  the optimizer's parameters, checkpoints and the refit are unchanged; only the GEMMs cast their
  operands to float8 with dynamic scales (the recipe's). CUDA's float8 GEMM needs every inner
  dim divisible by 16: the forward's and input gradient's inner dims are the weight's (the plan
  keeps only such linears), but the weight gradient's is the microbatch's token count, so that
  GEMM zero-pads it (torchao's `pad_inner_dim`, for that GEMM alone: padding the other two would
  only copy).
- `LinearLoRA` layers keep their class: their frozen base GEMM calls `FrozenWeightFloat8Linear`
  (the same torchao casts, but no weight-gradient GEMM: the base weight takes no gradient) and
  the adapter runs beside it in its compute dtype.

The decisions (which linears, whether this device can) are `functional.float8_training`'s;
here are the facts they take and the effects. Where float8 cannot run, one warning per process
and per reason says why, and the model is left as it was. torchao is an optional extra
(`policyworker[fp8]`), imported only here and only when fp8 is requested.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from attrs import frozen
from torch import nn

from policyworker._lazy import installed_version
from policyworker.functional.float8_training import (
    Float8Plan,
    LinearSpec,
    float8_plan,
    float8_unsupported_reason,
)

__all__ = [
    "Float8Report",
    "FrozenWeightFloat8Linear",
    "apply_float8_training",
    "float8_matmuls_paused",
    "float8_support",
    "linear_specs",
]

log = logging.getLogger("policyworker")
_WARNED: set[str] = set()  # fallback reasons already warned about in this process


@frozen(kw_only=True)
class Float8Report:
    """What `apply_float8_training` did: the recipe, the linears converted (plain and LoRA
    base GEMMs), how many stayed, and why nothing was converted (`fallback_reason`)."""

    requested: bool = False
    recipe: str | None = None
    converted: tuple[str, ...] = ()
    lora: tuple[str, ...] = ()
    num_skipped: int = 0
    fallback_reason: str | None = None

    @property
    def active(self) -> bool:
        """Whether any GEMM runs in float8."""
        return bool(self.converted or self.lora)

    def summary(self) -> str:
        """One phrase for the start-up log line."""
        if not self.requested:
            return "off"
        if self.fallback_reason is not None:
            return f"off (fell back: {self.fallback_reason})"
        lora = f" + {len(self.lora)} LoRA base GEMMs" if self.lora else ""
        return (
            f"{self.recipe} on {len(self.converted)} linears{lora}, "
            f"{self.num_skipped} kept in high precision"
        )


def float8_support(device: torch.device, *, tp_size: int = 1) -> str | None:
    """Why float8 training cannot run on `device` (None: it can)."""
    capability = None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
    return float8_unsupported_reason(
        device_type=device.type,
        capability=capability,
        torchao_version=installed_version("torchao"),
        has_scaled_mm=hasattr(torch, "_scaled_mm"),
        tp_size=tp_size,
    )


def _decoder_layer_names(model: nn.Module) -> tuple[str, ...]:
    # The same rule as the layer compile: the elements of ModuleLists named `layers`.
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            names.extend(f"{name}.{i}" for i in range(len(module)))
    return tuple(names)


def linear_specs(model: nn.Module) -> tuple[LinearSpec, ...]:
    """Every `nn.Linear` of `model` (LoRA layers included, their adapters' own linears not)."""
    from policyworker.shell.model.lora import LinearLoRA

    adapter_parts: set[int] = set()
    for module in model.modules():
        if isinstance(module, LinearLoRA):
            adapter_parts.update((id(module.lora_A), id(module.lora_B)))
    return tuple(
        LinearSpec(
            name=name,
            in_features=m.in_features,
            out_features=m.out_features,
            lora=isinstance(m, LinearLoRA),
        )
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m) not in adapter_parts
    )


def _warn_once(reason: str) -> None:
    message = f"dtensor_cfg.fp8 is set but float8 training cannot run here: {reason}; training "
    message += "continues without float8 (as if dtensor_cfg.fp8 were absent)"
    if message in _WARNED:
        return
    _WARNED.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning("%s", message)


def apply_float8_training(
    model: nn.Module,
    fp8_cfg: Any,
    *,
    device: torch.device,
    tp_size: int = 1,
    check_device: bool = True,
) -> Float8Report:
    """Convert the decoder layers' linears of `model` to float8 training in place.

    Args:
        fp8_cfg: `dtensor_cfg.fp8` (a `Float8Config`), or None: nothing to do.
        check_device: False converts whatever the device (tests: torch has a CPU kernel for
            `torch._scaled_mm`, so the conversion and torchao's float8 GEMMs run on the CPU;
            slower than high precision there, so never a training mode).
    """
    if fp8_cfg is None:
        return Float8Report()
    recipe = str(fp8_cfg.recipe)
    reason = float8_support(device, tp_size=tp_size) if check_device else None
    if reason is not None:
        _warn_once(reason)
        return Float8Report(requested=True, recipe=recipe, fallback_reason=reason)
    from policyworker.shell.refit.weight_stream import keep_fp32_patterns

    plan = float8_plan(
        linear_specs(model),
        layer_prefixes=_decoder_layer_names(model),
        keep_fp32=keep_fp32_patterns(model),
    )
    from torchao.float8 import Float8LinearConfig

    _convert(model, plan, Float8LinearConfig.from_recipe_name(recipe))
    return Float8Report(
        requested=True,
        recipe=recipe,
        converted=plan.converted,
        lora=plan.lora,
        num_skipped=len(plan.skipped),
    )


@contextlib.contextmanager
def float8_matmuls_paused(model: nn.Module, report: Float8Report) -> Iterator[None]:
    """Inside, the linears ``report`` converted compute in their own precision (``nn.Linear``'s
    forward; LoRA's base GEMM without ``fp8_linear``). For probes of another kernel: the
    document-isolation probe tests attention, and a per-tensor float8 scale (one amax over the
    whole packed row) lets one document's values move another's rounding."""
    plain = [model.get_submodule(name) for name in report.converted]
    # Any: LinearLoRA's attribute, which torch's nn.Module types as Tensor | Module
    lora: list[tuple[Any, Any]] = [
        (layer, layer.fp8_linear) for layer in map(model.get_submodule, report.lora)
    ]
    for layer in plain:  # an instance attribute shadows Float8Linear.forward
        layer.forward = types.MethodType(nn.Linear.forward, layer)
    for layer, _ in lora:
        layer.fp8_linear = None
    try:
        yield
    finally:
        for layer in plain:
            del layer.forward
        for layer, fp8_linear in lora:
            layer.fp8_linear = fp8_linear


def _convert(model: nn.Module, plan: Float8Plan, config: Any) -> None:
    from torchao.float8 import convert_to_float8_training

    chosen = set(plan.converted)
    if chosen:
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen
        )
    for name in plan.converted:
        layer: Any = model.get_submodule(name)
        mm = layer.linear_mm_config  # read by Float8Linear.forward at each call
        layer.linear_mm_config = mm._replace(
            grad_weight=mm.grad_weight._replace(pad_inner_dim=True)
        )
    from policyworker.shell.model.lora import LinearLoRA

    for name in plan.lora:
        lora = model.get_submodule(name)
        assert isinstance(lora, LinearLoRA), name
        lora.fp8_linear = FrozenWeightFloat8Linear(config)


# ---------------------------------------------------------------------------- LoRA base GEMM


class FrozenWeightFloat8Linear:
    """``x W^T`` with both operands cast to float8 as torchao's `Float8Linear` casts them, for a
    weight that takes no gradient (a LoRA layer's frozen base): the backward computes only the
    input gradient, skipping the [O, I] weight-gradient GEMM torchao's matmul always runs.
    Called by `LinearLoRA` in place of `F.linear(x, weight)` (bias added by the caller)."""

    def __init__(self, config: Any) -> None:
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.config = config
        gemms = (config.gemm_config_output, config.gemm_config_grad_input)
        self.linear_mm_config = LinearMMConfig(
            *(
                ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                for gemm in (*gemms, config.gemm_config_grad_weight)
            )
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return _frozen_weight_matmul().apply(x, weight.t(), self.linear_mm_config, self.config)


_MATMUL: list[Any] = []


def _frozen_weight_matmul() -> Any:
    """The autograd Function, defined on first use (it subclasses nothing from torchao, but its
    body needs torchao's casts, and torchao is imported lazily)."""
    if not _MATMUL:
        _MATMUL.append(_define_matmul())
    return _MATMUL[0]


def _define_matmul() -> Any:
    from torchao.float8.float8_scaling_utils import (
        get_maybe_axiswise_dim,
        hp_tensor_to_float8_dynamic,
    )
    from torchao.float8.float8_training_tensor import GemmInputRole

    def cast(t: torch.Tensor, cast_config: Any, mm: Any, config: Any, role: Any, dim: int) -> Any:
        return hp_tensor_to_float8_dynamic(
            t,
            cast_config.target_dtype,
            mm,
            gemm_input_role=role,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(dim, cast_config.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )

    # allow_in_graph, as torchao's own matmul: dynamo records the call and AOTAutograd traces
    # the float8 tensor subclass inside it, so the layer compile fuses the casts.
    @torch._dynamo.allow_in_graph
    class FrozenWeightFloat8Matmul(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any, x_hp: torch.Tensor, weight_hp_t: torch.Tensor, mm: Any, config: Any
        ) -> torch.Tensor:
            ctx.save_for_backward(weight_hp_t)
            ctx.mm, ctx.config = mm, config
            x8 = cast(x_hp, config.cast_config_input, mm, config, GemmInputRole.INPUT, -1)
            w8 = cast(weight_hp_t, config.cast_config_weight, mm, config, GemmInputRole.WEIGHT, 0)
            out = torch.mm(x8.reshape(-1, x_hp.shape[-1]), w8)
            return out.reshape(*x_hp.shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            grad_out = grads[0]
            (weight_hp_t,) = ctx.saved_tensors
            mm, config = ctx.mm, ctx.config
            g = grad_out.reshape(-1, grad_out.shape[-1])
            g8 = cast(g, config.cast_config_grad_output, mm, config, GemmInputRole.GRAD_OUTPUT, -1)
            w8 = cast(
                weight_hp_t,
                config.cast_config_weight_for_grad_input,
                mm,
                config,
                GemmInputRole.WEIGHT,
                -1,
            )
            grad_x = torch.mm(g8, w8.t())
            return grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1]), None, None, None

    return FrozenWeightFloat8Matmul


def reset_warnings() -> None:
    """Forget which fallback reasons were warned about (tests)."""
    _WARNED.clear()

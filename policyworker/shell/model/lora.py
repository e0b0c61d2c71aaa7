"""LoRA on any Hugging Face model: the `LinearLoRA` module, its `lora_cfg` settings, injection.

`LinearLoRA` IS an `nn.Linear`: the base keeps its `weight`/`bias` state-dict names (the refit
generator merges `<module>.weight` with `<module>.lora_A.weight` / `<module>.lora_B.weight`
through `policyworker.functional.lora.merge_lora_weight`). Order of use in the worker:
`apply_lora(model, cfg)` (before TP and FSDP2) -> `parallelize_module(model, mesh,
lora_tp_plan(plan))` (`shell.lora_tp`) -> `fully_shard` -> optimizer over
`lora_parameters(model)`. The PEFT adapter folder (export/import) is `shell.peft_adapter`.

`LinearLoRA` has three forward paths: the general one; under autocast in the adapter's dtype,
the adapter merged into the frozen weight (`_MergedAdapterLinear`); or with input dropout added
inside the up-projection's GEMM. The `lora_cfg` settings it is built from are `lora_settings.py`.
"""

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from policyworker.functional.lora import (
    lora_scale,
    matches_target,
    merge_lora_weight,
    unmatched_entries,
)
from policyworker.shell.model.lora_settings import (
    LoRASettings,
    lora_settings,
    resolve_compute_dtype,
)

__all__ = [
    "LinearLoRA",
    "LoRASettings",
    "apply_lora",
    "lora_module_map",
    "lora_modules",
    "lora_parameters",
    "lora_settings",
    "lora_state_dict",
    "resolve_compute_dtype",
]

_WRAPPER_FRAGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class LinearLoRA(nn.Linear):
    """``y = x W^T + b + scale * B(A(dropout(x)))``: a frozen linear layer plus a low-rank adapter.

    ``lora_A`` [dim, in] (xavier-normal or kaiming-uniform) and ``lora_B`` [out, dim] (zeros) are
    fp32 ``nn.Linear`` submodules; the adapter path is computed in (at least) fp32 with autocast
    off and added in the base output's dtype. ``compute_dtype`` (e.g. bf16; `apply_lora` sets it
    from ``lora_cfg.compute_dtype``) trades that for speed: the fp32 path costs ~20% of a bf16
    train step on the 1.5B shape (bench/lora.py). The parameters stay fp32 either way. Dropout
    applies to the input (``"pre"``) or to the adapter output (``"post"``). Works on plain tensors
    and on DTensors (TP via `lora_tp_plan`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dim: int,
        alpha: float,
        use_rslora: bool = False,
        dropout: float = 0.0,
        dropout_position: Literal["pre", "post"] = "post",
        lora_A_init: Literal["xavier", "uniform"] = "xavier",  # noqa: N803
        compute_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_adapters(
            dim=dim,
            alpha=alpha,
            use_rslora=use_rslora,
            dropout=dropout,
            dropout_position=dropout_position,
            lora_A_init=lora_A_init,
            compute_dtype=compute_dtype,
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        dim: int,
        alpha: float,
        use_rslora: bool = False,
        dropout: float = 0.0,
        dropout_position: Literal["pre", "post"] = "post",
        lora_A_init: Literal["xavier", "uniform"] = "xavier",  # noqa: N803
        compute_dtype: torch.dtype | None = None,
    ) -> "LinearLoRA":
        """Wrap ``linear`` without copying: the new module holds the SAME weight/bias Parameters."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        module._init_adapters(
            dim=dim,
            alpha=alpha,
            use_rslora=use_rslora,
            dropout=dropout,
            dropout_position=dropout_position,
            lora_A_init=lora_A_init,
            compute_dtype=compute_dtype,
        )
        return module

    def _init_adapters(
        self,
        *,
        dim: int,
        alpha: float,
        use_rslora: bool,
        dropout: float,
        dropout_position: Literal["pre", "post"],
        lora_A_init: Literal["xavier", "uniform"],  # noqa: N803
        compute_dtype: torch.dtype | None,
    ) -> None:
        self.compute_dtype = compute_dtype
        self.adapter_enabled = True  # False: the frozen base layer alone (a base reference)
        # `dtensor_cfg.fp8` (shell.model.float8) sets a float8 GEMM for the frozen base weight
        self.fp8_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.scale = lora_scale(alpha, dim, use_rslora)
        self.dim, self.alpha, self.use_rslora = dim, float(alpha), use_rslora
        self.dropout_position, self.lora_A_init = dropout_position, lora_A_init
        device = self.weight.device
        self.lora_A = nn.Linear(
            self.in_features, dim, bias=False, device=device, dtype=torch.float32
        )
        self.lora_B = nn.Linear(
            dim, self.out_features, bias=False, device=device, dtype=torch.float32
        )
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """A: xavier-normal or kaiming-uniform (nn.Linear's default).

        B: zeros (so W is unchanged).
        """
        with torch.no_grad():
            if self.lora_A_init == "xavier":
                nn.init.xavier_normal_(self.lora_A.weight)
            else:
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    # nn.Linear calls its argument `input` (a builtin name); every caller passes it positionally
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        if not self.adapter_enabled:
            return self._base(x)
        a, b = self.lora_A.weight, self.lora_B.weight
        acc = self._adapter_dtype()
        if self._adapter_in_autocast_dtype(x.device.type, acc):
            # `x` is cast once for the base layer and the adapter: autocast would cast it again
            # for each, and backward would cast and add two fp32 input gradients.
            x_c = x.to(acc)
            if self._merges():
                return _MergedAdapterLinear.apply(x_c, self.weight, self.bias, a, b, self.scale)
            if not self._drops_adapter_output():
                return self._forward_with_addmm(x_c, a, b)
        base = self._base(x)
        h = self.dropout(x) if self.dropout_position == "pre" else x
        # fp32 adapters: a bf16 autocast would otherwise run both small matmuls in bf16. The scale
        # multiplies the [.., R] intermediate, not the [.., O] output: one full pass less.
        with torch.autocast(device_type=x.device.type, enabled=False):
            delta = F.linear(F.linear(h.to(acc), a.to(acc)) * self.scale, b.to(acc))
        if self._drops_adapter_output():
            delta = self.dropout(delta)
        return base + delta.to(base.dtype)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen base layer's output: float8 GEMM when `fp8_linear` is set (and the base
        is frozen, as `apply_lora` leaves it: that GEMM gives the weight no gradient)."""
        if self.fp8_linear is None or self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        out = self.fp8_linear(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def merged_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, bias) in ``dtype`` that compute this layer as one plain linear under an
        autocast to ``dtype``: the refit's merged weight, as `forward` uses it there. None where
        `forward` keeps the adapter apart (see `_merges`). Values only: no autograd graph."""
        plain = not isinstance(self.weight, DTensor)
        if not (dtype == self._adapter_dtype() and plain and self._merges()):
            return None
        with torch.no_grad():
            a, b = self.lora_A.weight, self.lora_B.weight
            merged = merge_lora_weight(self.weight, a, b, self.scale).to(dtype)
            return merged, None if self.bias is None else self.bias.to(dtype)

    def _adapter_dtype(self) -> torch.dtype:
        a, b = self.lora_A.weight, self.lora_B.weight
        return self.compute_dtype or torch.promote_types(
            torch.promote_types(a.dtype, b.dtype), torch.float32
        )

    def _adapter_in_autocast_dtype(self, device: str, acc: torch.dtype) -> bool:
        """Whether the adapter computes in the dtype autocast gives the base layer (bf16 adapters
        under bf16 autocast, the CUDA default), on plain tensors (TP shards keep the general
        path)."""
        return (
            torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == acc
            and not isinstance(self.weight, DTensor)
        )

    def _merges(self) -> bool:
        """Whether the adapter can be merged into the base weight for this call: the adapter
        sees the base layer's input (no active dropout), the base takes no gradient
        (`apply_lora` freezes it; the merged path has no gradient for it), and the base GEMM is
        not float8 (`fp8_linear`: the adapter then stays apart, in its compute dtype)."""
        if self.fp8_linear is not None:
            return False
        no_dropout = isinstance(self.dropout, nn.Identity) or not self.training
        base_trains = self.weight.requires_grad or (
            self.bias is not None and self.bias.requires_grad
        )
        return no_dropout and not base_trains

    def _drops_adapter_output(self) -> bool:
        return self.dropout_position == "post" and not isinstance(self.dropout, nn.Identity)

    def _forward_with_addmm(
        self, x_c: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        """``base + scale * (h A^T) B^T`` for input dropout (the adapter sees another input than
        the base, so no merge) or a float8 base GEMM: the up-projection adds onto the base output
        inside its GEMM (addmm, `alpha=scale`) instead of a separate pass over the [.., O]
        output."""
        base = self._base(x_c)
        h = self.dropout(x_c) if self.dropout_position == "pre" else x_c
        down = F.linear(h, a.to(x_c.dtype))
        out = torch.addmm(
            base.reshape(-1, base.shape[-1]),
            down.reshape(-1, down.shape[-1]),
            b.to(x_c.dtype).t(),
            alpha=self.scale,
        )
        return out.reshape(base.shape)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, dim={self.dim}, alpha={self.alpha}, scale={self.scale:g}, "
            f"dropout_position={self.dropout_position}, compute_dtype={self.compute_dtype}"
        )


class _MergedAdapterLinear(torch.autograd.Function):
    """``x W'^T + b`` with ``W' = cast(W + scale * B A)``: a LoRA layer as one GEMM.

    The merged weight is `merge_lora_weight` cast to `x`'s dtype (the compute dtype): bit for bit
    the weight the refit sends an engine in that dtype, so the trainer scores tokens with the
    engine's weights. Against the base GEMM, two adapter GEMMs and an addmm onto the output, the
    forward skips one read of the [N, I] input and a read and write of the [N, O] output, and
    the backward's input gradient is one GEMM instead of a GEMM and an addmm over [N, I] (less
    one read of the input to rebuild ``x A^T``). The merge is one fp32 GEMM (W is its
    accumulator input), then the cast, eagerly and under torch.compile alike. Inductor's own
    kernel for the merge written as a sum over R of broadcast products, fused with the cast, ran
    7x slower on an H200 than the GEMM and the cast (0.50 ms against 0.07 ms at [8960, 1536]);
    the 1.5B LoRA train step gained 1.16x when it went. A compiled layer's merge is
    therefore bit for bit the eager one, and the refit's.

    Backward needs no [O, I] weight gradient (W and b are frozen): ``dx = g W'``, and the
    adapters' gradients from the rank-R products ``g B`` and ``x A^T`` (the latter recomputed:
    an [N, R] tensor is cheaper to rebuild than to keep through the step).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_c: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        with torch.autocast(x_c.device.type, enabled=False):
            merged = merge_lora_weight(weight, lora_a, lora_b, scale).to(x_c.dtype)
            out = F.linear(x_c, merged, None if bias is None else bias.to(x_c.dtype))
        ctx.save_for_backward(x_c, merged, lora_a, lora_b)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_c, merged, lora_a, lora_b = ctx.saved_tensors
        grad_out = grads[0]
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_x = grad_out @ merged if ctx.needs_input_grad[0] else None
            rows_NO = grad_out.reshape(-1, grad_out.shape[-1]).to(merged.dtype)
            x_NI = x_c.reshape(-1, x_c.shape[-1])
            down_NR = x_NI @ lora_a.to(merged.dtype).t()
            up_grad_NR = rows_NO @ lora_b.to(merged.dtype)
            grad_a = (up_grad_NR.t() @ x_NI).to(lora_a.dtype).mul_(ctx.scale)
            grad_b = (rows_NO.t() @ down_NR).to(lora_b.dtype).mul_(ctx.scale)
        return grad_x, None, None, grad_a, grad_b, None


def _canonical(name: str) -> str:
    for fragment in _WRAPPER_FRAGMENTS:
        name = name.replace(fragment, "")
    return name.removeprefix("module.")


def lora_modules(model: nn.Module) -> dict[str, LinearLoRA]:
    """Every `LinearLoRA` of ``model`` by its canonical dotted name (wrapper fragments removed)."""
    return {_canonical(name): m for name, m in model.named_modules() if isinstance(m, LinearLoRA)}


lora_module_map = lora_modules  # the name docs/internals.md uses


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (A then B of each module, in module order): the optimizer's params."""
    # nn.Linear.weight is always an nn.Parameter; torch's stubs declare it as a plain Tensor
    return [
        cast(nn.Parameter, p)
        for m in lora_modules(model).values()
        for p in (m.lora_A.weight, m.lora_B.weight)
    ]


def _set_child(model: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, child)


def _inject(
    model: nn.Module,
    names: Iterable[str],
    *,
    dims: Mapping[str, int],
    s: LoRASettings,
    autocast_dtype: torch.dtype | None,
) -> None:
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear) and not isinstance(linear, LinearLoRA), name
        _set_child(
            model,
            name,
            LinearLoRA.from_linear(
                linear,
                dim=dims[name],
                alpha=s.alpha,
                use_rslora=s.use_rslora,
                dropout=s.dropout,
                dropout_position=s.dropout_position,
                lora_A_init=s.lora_A_init,
                compute_dtype=resolve_compute_dtype(
                    s.compute_dtype,
                    device=linear.weight.device,
                    base_dtype=autocast_dtype or linear.weight.dtype,
                ),
            ),
        )
    adapters = {id(p) for p in lora_parameters(model)}
    for param in model.parameters():
        param.requires_grad_(id(param) in adapters)


def _linear_names(model: nn.Module) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, LinearLoRA)
    ]


def apply_lora(
    model: nn.Module, lora_cfg: Any, *, autocast_dtype: torch.dtype | None = None
) -> list[str]:
    """Replace the matching ``nn.Linear`` modules by `LinearLoRA` in place; freeze everything else.

    ``lora_cfg`` is a `policyworker.config.LoRAConfig` or a mapping with its keys (a mapping
    with ``enabled: false`` changes nothing and returns ``[]``). Call it before TP and FSDP2.
    ``autocast_dtype`` is the dtype the train step's autocast runs the base layers in (None: no
    autocast); with ``compute_dtype: auto`` a bfloat16 one on CUDA gives bfloat16 adapters.

    Returns:
        The dotted names of the replaced modules, in module order.

    Raises:
        ValueError: nothing matches, a ``target_modules``/``exclude_modules`` entry matches no
            linear module (a typo would otherwise silently train fewer layers), the model already
            has LoRA modules, or a bad setting.
    """
    s = lora_settings(lora_cfg)
    if not s.enabled:
        return []
    if lora_modules(model):
        msg = "apply_lora: the model already has LinearLoRA modules; apply LoRA once per model"
        raise ValueError(msg)
    candidates = _linear_names(model)
    unmatched = [] if s.match_all_linear else unmatched_entries(candidates, s.target_modules)
    unmatched_excludes = unmatched_entries(candidates, s.exclude_modules)
    chosen = [
        n
        for n in candidates
        if matches_target(
            n, s.target_modules, s.exclude_modules, match_all_linear=s.match_all_linear
        )
    ]
    if unmatched or unmatched_excludes or not chosen:
        sample = candidates[:8] + (["..."] if len(candidates) > 8 else [])
        msg = (
            f"lora_cfg selects no usable set of nn.Linear modules: target_modules="
            f"{list(s.target_modules)}, exclude_modules={list(s.exclude_modules)}, "
            "match_all_linear="
            f"{s.match_all_linear}; entries matching no linear module: "
            f"{unmatched + unmatched_excludes}; selected: {len(chosen)}. Entries match a dotted "
            f"module name or its '.'-suffix, an Automodel wildcard ('*_proj'), or "
            f"'re:<full-match regex>'; linear modules here: {sample}"
        )
        raise ValueError(msg)
    _inject(model, chosen, dims=dict.fromkeys(chosen, s.dim), s=s, autocast_dtype=autocast_dtype)
    return chosen


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # DTensor: a collective on every rank
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{<module>.lora_A.weight: [R, I], <module>.lora_B.weight: [O, R]}`` as full CPU tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A.weight"] = _full(m.lora_A.weight.detach()).cpu().contiguous()
        out[f"{name}.lora_B.weight"] = _full(m.lora_B.weight.detach()).cpu().contiguous()
    return out

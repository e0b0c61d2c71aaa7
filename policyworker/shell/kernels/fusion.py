"""Elementwise fusion for the training model through `torch.compile` (inductor).

A bf16-autocast train step over fp32 master weights spends much of its device time in small
unfused kernels: RMSNorm's fp32 upcast / pow / mean / rsqrt / mul / cast back / weight mul and
the MLP's SiLU(gate) * up. `fuse_elementwise` replaces module forwards (instance attributes, so
`unfuse_elementwise` restores them by deleting the attribute):

- ``"norm_mlp"``: every Hugging Face-style RMSNorm calls one compiled `rms_norm_reference`, and
  every SiLU-gated MLP calls one compiled `silu_mul_reference` between its projections. The
  projections stay submodule calls, so LoRA / peft wrappers around them keep working.
- ``"layer"``: every decoder layer (the elements of `nn.ModuleList`s named ``layers``) runs its
  class's forward through one compiled function per class, so all layers share one graph.
- ``"none"``: nothing.
- ``"auto"`` (the config's default): ``"layer"`` on CUDA in a single process, ``"none"`` on
  CPU and under a process group (`resolve_fusion_mode`).

Compiled graphs persist on disk (`shell.compile_cache.use_persistent_compile_cache`), so a
second process on the machine reuses the first one's compiles instead of paying the start-up
cost again.

Compile errors surface only at the first call, so fusing probes: one tiny eager forward of the
whole model (train mode, a [2, 3] batch called like a padded microbatch, under `autocast_dtype`)
records each module's inputs, and each distinct kind of call then runs fused and eager on them,
values and gradients compared. On any failure every replacement is undone, one warning names
the reason (a `RuntimeWarning`, and once per reason a WARNING record of the ``policyworker``
logger) and the report carries it as `fallback_reason`. The probe's graphs are the ones a
padded train step reuses; a packed [1, N] microbatch (dynamo specialises size-1 dims) and eval
mode compile one more graph each at first use. Active dropout inside a compiled layer cannot
match eager (inductor draws other random numbers), so "layer" falls back for such models.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Callable
from typing import Any, get_args

import attrs
import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn

from policyworker.config import FusionMode
from policyworker.shell.kernels.compile_cache import compiled_once, use_persistent_compile_cache
from policyworker.shell.kernels.fusion_probe import (
    call_signature,
    capture_inputs,
    first_line,
    probe_against_eager,
    rng_preserved,
    training_mode,
)
from policyworker.shell.model.hf_model import autocast_context

__all__ = [
    "FUSION_MODES",
    "FusionReport",
    "compiled_once",
    "fuse_elementwise",
    "resolve_fusion_mode",
    "rms_norm_reference",
    "silu_mul_reference",
    "unfuse_elementwise",
    "use_persistent_compile_cache",
]

FUSION_MODES: tuple[str, ...] = get_args(FusionMode)  # the config's `dtensor_cfg.fusion` values
# What "auto" compiles, by device type (in a single process); any other device runs eager.
_AUTO_MODES: dict[str, FusionMode] = {"cuda": "layer"}
log = logging.getLogger("policyworker")
_LOGGED_FALLBACKS: set[str] = set()  # fallback reasons already logged in this process
# Set on every module whose forward we replaced; unfuse deletes it together with the forward.
_FUSED_MARKER = "_policyworker_fused"
# The probe forward's batch: >= 2 so dynamo does not specialise a dim to 1 (that graph would
# not serve padded batches), and distinct so duck sizing does not tie batch and sequence dims.
_CHECK_ROWS = 3  # rows of the eager class checks


@frozen(kw_only=True)
class FusionReport:
    """What `fuse_elementwise` replaced; all counts are 0 when `fallback_reason` is set."""

    mode: str  # the mode fused (or tried): "auto" already resolved
    fused_norms: int = 0
    fused_mlps: int = 0
    fused_layers: int = 0
    fallback_reason: str | None = None
    requested: str | None = None  # the mode asked for ("auto", ...); None: the same as `mode`
    cache_dir: str | None = None  # inductor's on-disk cache for the compiled graphs
    # The next-token logprob kernels (shell.fused_logprobs): "fused" or "eager", and why a
    # fused pair fell back.
    logprobs: str = "eager"
    logprobs_fallback_reason: str | None = None

    @property
    def effective_mode(self) -> str:
        """What runs: `mode`, or "none" after a fallback."""
        return "none" if self.fallback_reason is not None else self.mode

    def summary(self) -> str:
        """One phrase for the start-up log line, e.g. "layer (auto)" or "none (layer fell back:
        RuntimeError: ...)"."""
        text = (
            self.mode if self.requested in (None, self.mode) else f"{self.mode} ({self.requested})"
        )
        if self.fallback_reason is not None:
            text = f"none ({self.mode} fell back: {self.fallback_reason})"
        if self.logprobs_fallback_reason is not None:
            return f"{text}; logprobs eager (fused fell back: {self.logprobs_fallback_reason})"
        return f"{text}; logprobs {self.logprobs}" if self.logprobs != "eager" else text


def resolve_fusion_mode(
    mode: FusionMode, *, device: torch.device, distributed: bool = False
) -> FusionMode:
    """The mode "auto" stands for: "layer" on CUDA in a single process, else "none".

    Other modes are returned as they are.
    """
    if mode != "auto":
        return mode
    return "none" if distributed else _AUTO_MODES.get(device.type, "none")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2/Qwen3 RMSNorm forward, op for op (the cast back happens
    before the weight multiply, so an fp32 weight promotes a bf16 input's output to fp32)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated-MLP activation `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = SiLU."""
    return F.silu(gate) * up


# ---------------------------------------------------------------------------- fused forwards


def _fused_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return compiled_once("rms_norm", rms_norm_reference)(
        hidden_states, self.weight, _norm_eps(self)
    )


def _fused_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(compiled_once("silu_mul", silu_mul_reference)(gate, up))


# ---------------------------------------------------------------------------- matching


def _norm_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def _looks_like_rms_norm(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return (
        type(module).__name__.endswith("RMSNorm")
        and weight is not None
        and weight.ndim == 1
        and _norm_eps(module) is not None
    )


def _looks_like_silu_mlp(module: nn.Module) -> bool:
    if not all(
        isinstance(getattr(module, n, None), nn.Module)
        for n in ("gate_proj", "up_proj", "down_proj")
    ):
        return False
    act = getattr(module, "act_fn", None)
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    return (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation") and (
        hidden_act in ("silu", "swish")
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@torch.no_grad()
def _norm_class_matches(module: Any) -> bool:
    """The class's own forward equals `rms_norm_reference` bit for bit (Gemma-style `1 + w` or
    a cast after the weight multiply would not), for fp32 and bf16 inputs."""
    weight, eps = module.weight, _norm_eps(module)
    if eps is None:
        return False
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(_CHECK_ROWS, weight.shape[0], device=weight.device).to(dtype)
        expected = type(module).forward(module, x)
        if not _same(rms_norm_reference(x, weight, eps), expected):
            return False
    return True


@torch.no_grad()
def _mlp_class_matches(module: Any, device: torch.device) -> bool:
    """The class's own forward equals down(silu(gate(x)) * up(x)) bit for bit (same seed for
    both, so dropout inside LoRA-wrapped projections draws the same masks)."""
    in_features = getattr(module.gate_proj, "in_features", None)  # nn.Linear, LoRA and peft
    if not isinstance(in_features, int):
        return False
    x = torch.randn(_CHECK_ROWS, in_features, device=device, dtype=next(module.parameters()).dtype)
    torch.manual_seed(0)
    expected = type(module).forward(module, x)
    torch.manual_seed(0)
    got = module.down_proj(silu_mul_reference(module.gate_proj(x), module.up_proj(x)))
    return _same(got, expected)


def _matching(
    modules: list[nn.Module], class_matches: Callable[[nn.Module], bool]
) -> list[nn.Module]:
    verdict: dict[type, bool] = {}
    for module in modules:
        if type(module) not in verdict:
            verdict[type(module)] = class_matches(module)
    return [m for m in modules if verdict[type(m)]]


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            layers.extend(module)
    return layers


# ---------------------------------------------------------------------------- public API


def fuse_elementwise(
    model: nn.Module,
    *,
    mode: FusionMode = "norm_mlp",
    autocast_dtype: torch.dtype | None = None,
    distributed: bool = False,
    float8: bool = False,
) -> FusionReport:
    """Replace module forwards of `model` with compiled fused ones; see the module docstring.

    Calling it again with "norm_mlp" or "layer" first restores the earlier fusion, so a module
    is never wrapped twice; "none" leaves the model as it is. "auto" is resolved by
    `resolve_fusion_mode` on the model's device.

    Args:
        autocast_dtype: the autocast dtype the train step runs under (None or float32: none).
            The probe runs under the same autocast, so its compiled graphs are the ones the
            train step reuses instead of recompiling.
        distributed: the model is (or will be) sharded by FSDP2/TP: "auto" means "none".
        float8: linears run float8 GEMMs (`dtensor_cfg.fp8`): the probe compares in norm.

    Raises:
        ValueError: `mode` is not one of FUSION_MODES.
    """
    if mode not in FUSION_MODES:
        msg = f"mode={mode!r} is not a fusion mode; use one of {', '.join(map(repr, FUSION_MODES))}"
        raise ValueError(msg)
    device = next(model.parameters()).device
    requested, mode = mode, resolve_fusion_mode(mode, device=device, distributed=distributed)
    if mode == "none":
        return FusionReport(mode=mode, requested=requested)
    unfuse_elementwise(model)
    cache_dir = use_persistent_compile_cache()
    dtype = autocast_dtype or torch.float32
    try:
        with rng_preserved(device), training_mode(model):
            if mode == "norm_mlp":
                report = _fuse_norm_mlp(model, device=device, autocast_dtype=dtype, float8=float8)
            else:
                report = _fuse_layers(model, device=device, autocast_dtype=dtype, float8=float8)
    except Exception as exc:  # any compile or probe failure: fall back to the eager model
        unfuse_elementwise(model)
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        message = f"fuse_elementwise(mode={mode!r}) fell back to the unfused model: {reason}"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        if message not in _LOGGED_FALLBACKS:
            _LOGGED_FALLBACKS.add(message)
            log.warning("%s (requested fusion: %s; training runs eager)", message, requested)
        return FusionReport(
            mode=mode, fallback_reason=reason, requested=requested, cache_dir=cache_dir
        )
    return attrs.evolve(report, requested=requested, cache_dir=cache_dir)


def unfuse_elementwise(model: nn.Module) -> int:
    """Restore the class forwards of every module `fuse_elementwise` replaced; return how many."""
    restored = 0
    for module in model.modules():
        if module.__dict__.pop(_FUSED_MARKER, False):
            module.__dict__.pop("forward", None)
            restored += 1
    return restored


def _install(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.__dict__["forward"] = types.MethodType(forward, module)
    module.__dict__[_FUSED_MARKER] = True


# ---------------------------------------------------------------------------- modes


def _fuse_norm_mlp(
    model: nn.Module, *, device: torch.device, autocast_dtype: torch.dtype, float8: bool
) -> FusionReport:
    norms = _matching([m for m in model.modules() if _looks_like_rms_norm(m)], _norm_class_matches)
    mlps = _matching(
        [m for m in model.modules() if _looks_like_silu_mlp(m)],
        lambda m: _mlp_class_matches(m, device),
    )
    _fuse_andprobe_against_eager(
        model,
        {m: _fused_norm_forward for m in norms} | {m: _fused_mlp_forward for m in mlps},
        device,
        autocast_dtype,
        float8,
    )
    return FusionReport(mode="norm_mlp", fused_norms=len(norms), fused_mlps=len(mlps))


def _fuse_layers(
    model: nn.Module, *, device: torch.device, autocast_dtype: torch.dtype, float8: bool
) -> FusionReport:
    # One compiled function per layer class: dynamo then reuses one graph for all its layers.
    layers = _decoder_layers(model)
    forwards = {layer: compiled_once(type(layer), type(layer).forward) for layer in layers}
    _fuse_andprobe_against_eager(model, forwards, device, autocast_dtype, float8)
    return FusionReport(mode="layer", fused_layers=len(layers))


def _fuse_andprobe_against_eager(
    model: nn.Module,
    forwards: dict[nn.Module, Callable[..., Any]],
    device: torch.device,
    autocast_dtype: torch.dtype,
    float8: bool = False,
) -> None:
    """Install `forwards`, then check each distinct kind of call against the class forward on
    the inputs the modules got in one tiny eager forward of the whole model.

    Real inputs rather than synthetic ones: dynamo guards on dtype, rank, requires_grad and on
    the base of a view (Qwen3's q_norm gets a view of q_proj's output), so only inputs made the
    way the train step makes them give graphs that the train step reuses.
    """
    with autocast_context(device, autocast_dtype):
        captured = capture_inputs(model, list(forwards), device)
        for module, forward in forwards.items():
            _install(module, forward)
        probed: set[tuple[Any, ...]] = set()
        for module in forwards:
            if id(module) not in captured:
                continue  # not on the probe forward's path (e.g. unused); compiled when first used
            args, kwargs = captured[id(module)]
            key = call_signature(module, args)
            if key not in probed:
                probed.add(key)
                probe_against_eager(module, args, kwargs, autocast_dtype, float8=float8)

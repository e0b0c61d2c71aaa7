"""The start-up check of `fuse_elementwise`: each fused forward against its class's eager one.

Compile errors surface only at the first call, so `shell/kernels/fusion.py` runs one tiny eager
forward of the whole model, captures each fused module's real inputs, and compares the fused
forward to the class forward on them, in value and in gradients. Separate from the fusion modes
because it is the part that must never change what training computes: it only raises.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "call_signature",
    "capture_inputs",
    "first_line",
    "probe_against_eager",
    "rng_preserved",
    "training_mode",
]

_PROBE_BATCH, _PROBE_SEQ = 2, 3


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


@contextlib.contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    # Dynamo guards on `module.training`: probing in train mode compiles the graphs the train
    # step reuses (a model fresh from `from_pretrained` is in eval mode).
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def rng_preserved(device: torch.device) -> Iterator[None]:
    # The probe draws random inputs (and LoRA dropout masks); training must not see that.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        yield


def capture_inputs(
    model: Any, modules: list[nn.Module], device: torch.device
) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
    """(args, kwargs) of each module's first call in one eager forward of a [2, 3] batch,
    called the way the worker calls a padded microbatch (expanded position ids, no mask)."""
    captured: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.setdefault(id(module), (args, kwargs))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        vocab = int(model.get_input_embeddings().num_embeddings)
        ids = torch.randint(0, vocab, (_PROBE_BATCH, _PROBE_SEQ), device=device)
        position_ids = torch.arange(_PROBE_SEQ, device=device).expand(_PROBE_BATCH, -1)
        model(input_ids=ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def call_signature(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x = args[0]
    params = tuple((p.shape, p.dtype, p.requires_grad) for p in module.parameters())
    return (type(module), params, x.dtype, x.dim(), x.requires_grad, x._base is not None)


# Float8 GEMMs (`dtensor_cfg.fp8`) round operands to 3 (e4m3) or 2 (e5m2) mantissa bits: where
# the compiled layer's bf16 rounding upstream of a cast differs from eager's, some operands land
# on the neighbouring float8 value, and single elements move by up to ~15% of the tensor's
# largest magnitude (a 512/1536 Qwen2 layer on the CPU; ~10% of the norm). The check is then on
# the norm of the difference: a broken compile misses by the norm itself.
_FLOAT8_NORM_RTOL = 0.3


def _assert_close_in_norm(module: nn.Module, what: str, got: Any, expected: Any) -> None:
    for g, e in zip(got, expected, strict=True):
        g, e = g.detach().float(), e.detach().float()
        diff, norm = float((g - e).norm()), float(e.norm())
        if not diff <= _FLOAT8_NORM_RTOL * max(norm, 1e-6):  # NaN fails too
            msg = (
                f"compiled vs eager {type(module).__name__} with float8 GEMMs: {what} differ "
                f"by {diff:.3g}, more than {_FLOAT8_NORM_RTOL} of their norm {norm:.3g}"
            )
            raise RuntimeError(msg)


def _assert_close(
    module: nn.Module,
    what: str,
    got: Any,
    expected: Any,
    compute_dtype: torch.dtype,
    *,
    float8: bool = False,
) -> None:
    """Equal up to a tolerance relative to each tensor's largest magnitude (its norm where
    float8 GEMMs run, see `_FLOAT8_NORM_RTOL`).

    Fused kernels reduce in another order (fp32: errors near 1e-7 of the scale) and, under
    bf16/fp16 autocast, may round an intermediate once where eager rounds it twice. The probe
    looks for broken compiles, which miss by the size of the values themselves.
    """
    if float8:
        _assert_close_in_norm(module, what, got, expected)
        return
    rtol = 1e-4 if compute_dtype == torch.float32 else 2e-2
    for g, e in zip(got, expected, strict=True):
        scale = float(e.detach().abs().max()) if e.numel() else 0.0
        try:
            torch.testing.assert_close(g, e, rtol=rtol, atol=rtol * max(scale, 1e-6))
        except AssertionError as exc:
            detail = next(
                (
                    line.strip()
                    for line in str(exc).splitlines()
                    if line.startswith("Greatest absolute")
                ),
                "",
            )
            msg = (
                f"compiled vs eager {type(module).__name__}: {what} differ by more than "
                f"rtol={rtol} of the largest magnitude {scale:.3g} ({detail}); active dropout "
                f"inside a compiled layer is one cause (inductor draws other random numbers)"
            )
            raise RuntimeError(msg) from exc


def probe_against_eager(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compute_dtype: torch.dtype,
    *,
    float8: bool = False,
) -> None:
    """The installed forward matches the class forward in value and in the gradients of the
    first input and the parameters (one random cotangent); raises otherwise. `float8`: the
    module's GEMMs run in float8 (compared in norm)."""
    if not (args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
        msg = f"{type(module).__name__} did not get a float tensor as its first positional input"
        raise TypeError(msg)

    def run(forward: Callable[..., Any]) -> torch.Tensor:
        torch.manual_seed(0)  # the same dropout masks (e.g. LoRA's) in the fused and eager runs
        out = forward(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    fused = run(module.forward)
    eager = run(functools.partial(type(module).forward, module))
    _assert_close(module, "outputs", [fused], [eager], compute_dtype, float8=float8)
    leaves = [t for t in (args[0], *module.parameters()) if t.requires_grad]
    if leaves:
        cotangent = torch.randn_like(eager)
        grads_fused = torch.autograd.grad(fused, leaves, cotangent, materialize_grads=True)
        grads_eager = torch.autograd.grad(eager, leaves, cotangent, materialize_grads=True)
        _assert_close(module, "gradients", grads_fused, grads_eager, compute_dtype, float8=float8)

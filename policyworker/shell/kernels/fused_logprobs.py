"""Fused next-token logprob kernels: the plain pair of `functional.logprob_kernels` in one pass.

Eagerly, scoring bf16 logits against their targets casts each chunk to fp32, reduces it, and in
backward casts it again, exponentiates, scales and casts back: about 50 bytes of memory traffic
per logit, every train step, over a ``[T, V]`` block that is the largest tensor of the step.
Fused, the forward is one reduction kernel (the logsumexp and the target logit from one read
of the bf16 logits) and the backward one pointwise kernel (one read, one bf16 write), so the
whole ``[T, V]`` block is scored in one call with no fp32 scratch. On CUDA they are the Triton
kernels of `shell.logprob_triton`; elsewhere inductor compiles the same two functions.

`fused_logprob_kernels` builds them when the fusion mode in effect is not "none" and checks
them at start-up against the eager pair on a small block of the model's real vocab size and
logits dtype (tolerance below); any failure keeps the eager pair and names the reason, as the
layer fusion does. Top-k/top-p filtering stays eager (``functional.logprobs``).
"""

from __future__ import annotations

import logging
import warnings

import torch

from policyworker.functional.logprob_kernels import (
    EAGER_KERNELS,
    LogprobKernels,
    plain_entropy,
    plain_logprob_grad,
    plain_logprobs_and_lse,
)
from policyworker.shell.kernels.compile_cache import compiled_once
from policyworker.shell.kernels.fusion_probe import first_line

__all__ = [
    "LOGPROB_ATOL",
    "LOGPROB_RTOL",
    "assert_logprob_grads_close",
    "fused_logprob_kernels",
    "inductor_kernels",
]

log = logging.getLogger("policyworker")
# Compiled vs eager, as checked at start-up: the fused reduction sums the vocab in another
# order (fp32), so logprobs and log-normalizers agree to `atol + rtol * |value|`; gradients
# within `assert_logprob_grads_close`'s bound.
LOGPROB_ATOL, LOGPROB_RTOL = 1e-4, 1e-5
_PROBE_ROWS, _PROBE_POSITIONS = 2, 5


def assert_logprob_grads_close(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    logits: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
) -> None:
    """Raise AssertionError unless two logprob gradients (``[..., V]``, for upstream ``grad``
    ``[...]``) agree as two correct fp32 computations of ``grad * (onehot - p) / T`` can.

    Each logit's gradient carries ``grad * p / T`` times the error of its exponent
    ``x / T - lse``, and that difference of two fp32 values near ``|lse|`` is exact only to a
    few units of ``eps * |lse|`` (another summation order or division by T moves it): at
    ``|lse|`` ≈ 20 one step is 2e-6 relative, beyond one rounding step of the result. So the
    bound is ``1e-6 + 4 * eps32 * (|lse| + 1) * |grad| / T`` per position, plus two rounding
    steps of the gradient's dtype relative to the value.
    """
    x = logits.float() / temperature
    lse = torch.logsumexp(x, dim=-1)
    eps32 = torch.finfo(torch.float32).eps
    per_position = 4 * eps32 * (lse.abs() + 1) * grad.float().abs() / temperature
    allowed = 1e-6 + per_position[..., None] + 2 * torch.finfo(want.dtype).eps * want.float().abs()
    diff = (got.float() - want.float()).abs()
    beyond = int((diff > allowed).sum())
    if beyond:
        worst = int((diff - allowed).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        msg = (
            f"logprob gradients differ at {beyond} of {diff.numel()} entries; worst at "
            f"{index}: |got - want| = {float(diff.flatten()[worst]):.3g}, allowed "
            f"{float(allowed.flatten()[worst]):.3g}"
        )
        raise AssertionError(msg)


def inductor_kernels() -> LogprobKernels:
    """The plain pair and the entropy compiled by inductor (once per process)."""
    return LogprobKernels(
        forward=compiled_once("logprobs_and_lse", plain_logprobs_and_lse),
        backward=compiled_once("logprob_grad", plain_logprob_grad),
        entropy=compiled_once("entropy", plain_entropy),
        whole=True,
        name="fused",
    )


def _fused_kernels(device: torch.device) -> LogprobKernels:
    """On CUDA the hand-written Triton pair (`shell.logprob_triton`: inductor's compile of the
    same math streams the logits at an eighth of the memory's speed there); elsewhere the
    plain pair compiled by inductor."""
    if device.type == "cuda":
        from policyworker.shell.kernels.logprob_triton import TRITON_KERNELS

        return TRITON_KERNELS
    return inductor_kernels()


def _check_against_eager(
    kernels: LogprobKernels,
    *,
    device: torch.device,
    vocab_size: int,
    dtype: torch.dtype,
    temperature: float,
) -> None:
    """Raise AssertionError unless `kernels` match the eager pair and entropy on a random
    block."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (_PROBE_ROWS, _PROBE_POSITIONS, vocab_size)
    logits = (4 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    targets = torch.randint(0, vocab_size, shape[:2], generator=gen, device=device)
    grad = torch.randn(shape[:2], generator=gen, device=device)
    got_lp, got_lse = kernels.forward(logits, targets, temperature)
    want_lp, want_lse = plain_logprobs_and_lse(logits, targets, temperature)
    torch.testing.assert_close(got_lp, want_lp, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    torch.testing.assert_close(got_lse, want_lse, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    got = kernels.backward(logits, targets, want_lse, grad, temperature)
    want = plain_logprob_grad(logits, targets, want_lse, grad, temperature)
    assert_logprob_grads_close(got, want, logits=logits, grad=grad, temperature=temperature)
    got_entropy = kernels.entropy(logits, temperature)
    want_entropy = plain_entropy(logits, temperature)
    torch.testing.assert_close(got_entropy, want_entropy, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)


def fused_logprob_kernels(
    fusion_mode: str,
    *,
    device: torch.device,
    vocab_size: int,
    logits_dtype: torch.dtype,
    temperature: float,
) -> tuple[LogprobKernels, str | None]:
    """(kernels, fallback reason): compiled kernels when `fusion_mode` (the mode in effect) is
    not "none" and they pass the start-up check, else the eager pair (reason None when fusion
    is off)."""
    if fusion_mode == "none":
        return EAGER_KERNELS, None
    try:
        kernels = _fused_kernels(device)
        _check_against_eager(
            kernels,
            device=device,
            vocab_size=vocab_size,
            dtype=logits_dtype,
            temperature=temperature,
        )
    except Exception as exc:  # any compile error or mismatch: keep the eager pair
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        message = f"fused logprob kernels fell back to eager: {reason}"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log.warning("%s (fusion: %s)", message, fusion_mode)
        return EAGER_KERNELS, reason
    return kernels, None

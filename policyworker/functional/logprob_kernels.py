"""The per-chunk math of next-token logprobs: forward (logprobs and log-normalizers) and backward.

``next_token_logprobs`` runs these over chunks of sequence positions. Forward returns, per
position, the fp32 logprob of its target and the log-normalizer ``lse = logsumexp(x)`` of the
(filtered, temperature-scaled) fp32 logits ``x``; backward gets that ``lse`` back, so it only
recomputes ``p = exp(x - lse)`` and writes the gradient ``g * (onehot(target) - p) / T`` in the
logits' dtype, with no second reduction over the vocab.

`LogprobKernels` carries the plain (unfiltered) pair, and the entropy of the same softmax
(``plain_entropy``, for `get_logprobs(entropy=True)`; filters never apply to it). The eager
functions here materialise fp32 ``[chunk, V]`` scratch, so their callers chunk positions; the
shell may pass the same functions compiled by inductor or written in Triton
(``shell.fused_logprobs.fused_logprob_kernels``), which read the bf16 logits once per pass and
keep the fp32 values in registers, so one call covers every position (``whole=True``).
Top-k / top-p filtering always runs eagerly (`filtered_kernels`; its sort per row is not worth
fusing, and it is off by default).

Shape legend: ``B`` batch, ``C`` positions of a chunk, ``V`` vocab. Pure functions: inputs are
never mutated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from attrs import frozen

from policyworker.functional.sampling import Sampling, sampling_keep_mask
from policyworker.functional.vocab_parallel import (
    entropy_from_partials,
    local_max,
    local_sum_exp,
    local_sum_exp_centered,
)

__all__ = [
    "EAGER_KERNELS",
    "LogprobKernels",
    "filtered_kernels",
    "filtered_logprob_grad",
    "filtered_logprobs_and_lse",
    "plain_entropy",
    "plain_logprob_grad",
    "plain_logprobs_and_lse",
]


def _logprobs_and_lse(
    x: torch.Tensor, targets_BC: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # The logprob comes from log_softmax, bit for bit what a plain fp32 `log_softmax(x)[t]`
    # gives (the demo's trainer/HF parity is exact); lse is the backward's normalizer.
    logprobs_BC = torch.log_softmax(x, dim=-1).gather(-1, targets_BC[..., None])[..., 0]
    return logprobs_BC, torch.logsumexp(x, dim=-1)


def plain_logprobs_and_lse(
    logits_BCV: torch.Tensor, targets_BC: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logprob of each target, fp32 logsumexp) of ``logits / temperature``, per position."""
    x = logits_BCV.float()
    if temperature != 1.0:
        x = x / temperature
    return _logprobs_and_lse(x, targets_BC)


def plain_logprob_grad(
    logits_BCV: torch.Tensor,
    targets_BC: torch.Tensor,
    lse_BC: torch.Tensor,
    grad_BC: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d(sum grad * logprob)/d logits = grad * (onehot(target) - softmax(x)) / T, logits' dtype.

    A position with ``lse = +inf`` and ``grad = 0`` (padding) gets an exact zero row.
    """
    x = logits_BCV.float()
    if temperature != 1.0:
        x = x / temperature
    g = grad_BC[..., None].float()
    is_target = torch.arange(x.shape[-1], device=x.device) == targets_BC[..., None]
    grad = torch.where(is_target, g, 0.0) - g * torch.exp(x - lse_BC[..., None])
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(logits_BCV.dtype)


def plain_entropy(logits_BCV: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 entropy ``-sum p log p`` of ``softmax(logits / temperature)`` per position (the
    vocab-parallel partials with the whole vocab as one shard: centred on the max, so large
    logits do not cancel)."""
    x = logits_BCV.to(torch.promote_types(logits_BCV.dtype, torch.float32))
    if temperature != 1.0:
        x = x / temperature
    max_BC = local_max(x)
    return entropy_from_partials(
        local_sum_exp(x, max_BC), local_sum_exp_centered(x, max_BC)
    ).float()


def _filtered_fp32(
    logits_BCV: torch.Tensor, sampling: Sampling
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 logits / T with -inf outside the kept set, the keep mask or None) of one chunk."""
    x = logits_BCV.float()
    if sampling.temperature != 1.0:
        x = x / sampling.temperature
    keep = sampling_keep_mask(x, top_k=sampling.top_k, top_p=sampling.top_p)
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return x, keep


def filtered_logprobs_and_lse(
    logits_BCV: torch.Tensor, targets_BC: torch.Tensor, sampling: Sampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """`plain_logprobs_and_lse` over the top-k/top-p kept set (a target outside it: -inf)."""
    x, _ = _filtered_fp32(logits_BCV, sampling)
    return _logprobs_and_lse(x, targets_BC)


def filtered_logprob_grad(
    logits_BCV: torch.Tensor,
    targets_BC: torch.Tensor,
    lse_BC: torch.Tensor,
    grad_BC: torch.Tensor,
    sampling: Sampling,
) -> torch.Tensor:
    """`plain_logprob_grad` over the kept set: filtered-out tokens get no gradient, and a target
    outside the set (its logprob is the constant -inf) keeps only the ``-g * softmax`` term."""
    x, keep = _filtered_fp32(logits_BCV, sampling)
    g = grad_BC[..., None].float()
    is_target = torch.arange(x.shape[-1], device=x.device) == targets_BC[..., None]
    if keep is not None:
        is_target = is_target & keep
    grad = torch.where(is_target, g, 0.0) - g * torch.exp(x - lse_BC[..., None])
    if sampling.temperature != 1.0:
        grad = grad / sampling.temperature
    return grad.to(logits_BCV.dtype)


LogprobForward = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
LogprobBackward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
LogprobEntropy = Callable[[torch.Tensor, float], torch.Tensor]


@frozen(kw_only=True)
class LogprobKernels:
    """The plain-sampling forward/backward pair `next_token_logprobs` calls per chunk, and the
    softmax's entropy `token_entropy` calls per chunk.

    ``whole=True`` declares that the three keep no fp32 ``[C, V]`` scratch (fused kernels), so
    the caller runs them once over all positions unless the user set a chunk size.
    """

    forward: LogprobForward = plain_logprobs_and_lse
    backward: LogprobBackward = plain_logprob_grad
    entropy: LogprobEntropy = plain_entropy
    whole: bool = False
    name: str = "eager"


EAGER_KERNELS = LogprobKernels()


def filtered_kernels(sampling: Sampling) -> LogprobKernels:
    """The top-k/top-p pair for `sampling` as a `LogprobKernels` (eager; the temperature the
    caller passes is `sampling`'s own)."""
    return LogprobKernels(
        forward=lambda logits, targets, _t: filtered_logprobs_and_lse(logits, targets, sampling),
        backward=lambda logits, targets, lse, grad, _t: filtered_logprob_grad(
            logits, targets, lse, grad, sampling
        ),
        name="filtered",
    )

"""Per-token terms the losses are built from: masked means, KL estimators, importance-weight
truncation and the ClippedPG metrics. All functions are pure.

Shape legend: ``B`` batch rows, ``T`` next-token positions (``S - 1``). Every ``*_BT`` tensor is
aligned with ``next_token_logprobs``: index ``t`` refers to token ``t + 1`` of the sequence.
Masks may be bool, integer or float; a float mask acts as a weight.
"""

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "KLType",
    "TruncationType",
    "approx_entropy",
    "js_divergence",
    "kl_estimate",
    "masked_extremes",
    "masked_mean",
    "mismatch_metrics",
    "ratio_metrics",
    "rowwise_masked_mean",
    "sanitize",
    "truncate_importance_weights",
]

KLType = Literal["k1", "k2", "k3"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis"]

MASKED_MEAN_EPS = 1e-8


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    global_normalization_factor: Tensor | float | None = None,
) -> Tensor:
    """``Σ(values·mask) / (factor + 1e-8)`` over ``dim`` (all dims when None); the factor
    defaults to ``mask.sum(dim)``. NeMo-RL's signature, so its losses call it unchanged.

    With the global count as the factor, the sum of this over microbatches is the batch mean.
    """
    mask = mask.to(values.dtype) if mask.dtype == torch.bool else mask
    if global_normalization_factor is None:
        factor = mask.sum() if dim is None else mask.sum(dim=dim)
    else:
        factor = global_normalization_factor
    # `where` keeps a NaN/inf at a masked position out of the sum (0 * inf would be NaN).
    weighted = torch.where(mask != 0, values * mask, 0.0)
    total = weighted.sum() if dim is None else weighted.sum(dim=dim)
    return total / (factor + MASKED_MEAN_EPS)


def rowwise_masked_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-row ``Σ_t(values·mask) / (Σ_t mask + 1e-8)`` -> [B]; a row with no tokens gives 0."""
    mask_BT = mask_BT.to(values_BT.dtype)
    return (values_BT * mask_BT).sum(-1) / (mask_BT.sum(-1) + MASKED_MEAN_EPS)


def sanitize(values: Tensor, keep: Tensor) -> Tensor:
    """``values`` where ``keep`` else 0, so masked positions can be neither NaN nor inf.

    Zeroing the *inputs* (not the outputs) keeps NaN out of the backward pass too: masked
    tokens then receive an exact zero gradient.
    """
    return torch.where(keep, values, 0.0)


def kl_estimate(
    logprobs_BT: Tensor,
    reference_logprobs_BT: Tensor,
    *,
    kl_type: KLType,
    input_clamp: float | None,
    output_clamp: float | None,
    weights_BT: Tensor | None = None,
) -> Tensor:
    """Schulman's per-token estimators of KL(π‖π_ref) on ``logr = ref − logprobs``.

    k1 = −logr, k2 = logr²/2, k3 = exp(logr) − 1 − logr. ``logr`` is clamped to
    ±``input_clamp`` first; the optional sampling ``weights_BT`` multiply the estimate before the
    ±``output_clamp``; where the input clamp is active the weights are detached, so the clamp
    removes the gradient of both factors.
    """
    logr_BT = reference_logprobs_BT - logprobs_BT
    if input_clamp is not None:
        clamped_BT = logr_BT.clamp(min=-input_clamp, max=input_clamp)
        if weights_BT is not None:
            weights_BT = torch.where(clamped_BT == logr_BT, weights_BT, weights_BT.detach())
        logr_BT = clamped_BT
    if kl_type == "k1":
        kl_BT = -logr_BT
    elif kl_type == "k2":
        kl_BT = logr_BT.square() / 2
    else:
        kl_BT = torch.exp(logr_BT) - 1 - logr_BT
    if weights_BT is not None:
        kl_BT = weights_BT * kl_BT
    if output_clamp is not None:
        kl_BT = kl_BT.clamp(min=-output_clamp, max=output_clamp)
    return kl_BT


def js_divergence(logprobs_a_BT: Tensor, logprobs_b_BT: Tensor) -> Tensor:
    """Per-token Jensen-Shannon estimate between two samplers (k3 form against the mixture)."""
    log_mix_BT = torch.logaddexp(logprobs_a_BT, logprobs_b_BT) - math.log(2.0)
    ra_BT, rb_BT = logprobs_a_BT - log_mix_BT, logprobs_b_BT - log_mix_BT
    return 0.5 * (torch.exp(ra_BT) - ra_BT - 1) + 0.5 * (torch.exp(rb_BT) - rb_BT - 1)


def truncate_importance_weights(
    weights: Tensor,
    *,
    kind: TruncationType,
    ratio_max: float,
    ratio_min: float | None,
    seq_log_ratio_mean_B: Tensor,
    mask_BT: Tensor,
    sample_mask_B: Tensor,
    global_valid_toks: Tensor | float,
    global_valid_seqs: Tensor | float,
) -> tuple[Tensor, dict[str, float]]:
    """Apply truncated importance sampling; return the new weights and ``is_oob_ratio``.

    ``tis`` clamps to [ratio_min or 0, ratio_max]; ``icepop`` zeroes weights outside
    [ratio_min, ratio_max]; ``seq-mask-tis`` zeroes whole rows whose geometric-mean ratio
    ``exp(seq_log_ratio_mean_B)`` lies outside [ratio_min, ratio_max] and keeps the others raw.
    ``weights`` is [B, T] (token-level) or [B, 1] (sequence-level).
    """
    with torch.no_grad():
        if kind == "seq-mask-tis":
            assert ratio_min is not None
            geo_mean_B = torch.exp(seq_log_ratio_mean_B)
            kept_B = ((geo_mean_B >= ratio_min) & (geo_mean_B <= ratio_max)).to(weights.dtype)
            oob = masked_mean(
                1.0 - kept_B, sample_mask_B, global_normalization_factor=global_valid_seqs
            )
            return weights * kept_B[:, None], {"is_oob_ratio": float(oob)}
        low = 0.0 if ratio_min is None else ratio_min
        kept = (weights >= low) & (weights <= ratio_max)
        oob_BT = torch.broadcast_to((~kept).to(mask_BT.dtype), mask_BT.shape)
        oob = masked_mean(oob_BT, mask_BT, global_normalization_factor=global_valid_toks)
    if kind == "tis":
        return weights.clamp(min=low, max=ratio_max), {"is_oob_ratio": float(oob)}
    return torch.where(kept, weights, torch.zeros_like(weights)), {"is_oob_ratio": float(oob)}


def masked_extremes(values_BT: Tensor, mask_BT: Tensor) -> tuple[float, float]:
    """(min, max) over positions where ``mask_BT`` is nonzero; (+inf, −inf) when there are none."""
    selected = values_BT.detach()[mask_BT != 0]
    if selected.numel() == 0:
        return math.inf, -math.inf
    return float(selected.min()), float(selected.max())


# ------------------------------------------------------------------------------ PG metrics


def mismatch_metrics(
    prev_BT: Tensor, gen_BT: Tensor, mask_BT: Tensor, *, kl_type: KLType, gvt: Tensor | float
) -> dict[str, float]:
    """Trainer-vs-sampler mismatch: token_mult_prob_error, gen/policy KL, JS divergence."""
    with torch.no_grad():
        prev_BT = prev_BT.detach()
        gen_kl_BT = kl_estimate(
            gen_BT, prev_BT, kl_type=kl_type, input_clamp=None, output_clamp=None
        )
        policy_kl_BT = kl_estimate(
            prev_BT, gen_BT, kl_type=kl_type, input_clamp=None, output_clamp=None
        )
        mult_BT = torch.exp((gen_BT - prev_BT).abs() * mask_BT)
        return {
            "token_mult_prob_error": float(
                masked_mean(mult_BT, mask_BT, global_normalization_factor=gvt)
            ),
            "gen_kl_error": float(masked_mean(gen_kl_BT, mask_BT, global_normalization_factor=gvt)),
            "policy_kl_error": float(
                masked_mean(policy_kl_BT, mask_BT, global_normalization_factor=gvt)
            ),
            "js_divergence_error": float(
                masked_mean(
                    js_divergence(prev_BT, gen_BT), mask_BT, global_normalization_factor=gvt
                )
            ),
        }


def ratio_metrics(
    ratios_BT: Tensor, clamped_BT: Tensor, mask_BT: Tensor, gvt: Tensor | float
) -> dict[str, float]:
    """Mean, min and max of the (clamped) probability ratios over valid tokens."""
    with torch.no_grad():
        r_min, r_max = masked_extremes(ratios_BT, mask_BT)
        c_min, c_max = masked_extremes(clamped_BT, mask_BT)
        return {
            "probs_ratio": float(
                masked_mean(ratios_BT.detach(), mask_BT, global_normalization_factor=gvt)
            ),
            "probs_ratio_clamped": float(
                masked_mean(clamped_BT.detach(), mask_BT, global_normalization_factor=gvt)
            ),
            "probs_ratio_min": r_min,
            "probs_ratio_max": r_max,
            "probs_ratio_clamped_min": c_min,
            "probs_ratio_clamped_max": c_max,
        }


def approx_entropy(curr_BT: Tensor, gen_BT: Tensor, mask_BT: Tensor, gvt: Tensor | float) -> float:
    """E_gen[−(π_curr/π_gen) log π_curr]: an entropy estimate from sampled-token logprobs only."""
    with torch.no_grad():
        curr_BT = curr_BT.detach()
        return float(
            -masked_mean(
                torch.exp(curr_BT - gen_BT) * curr_BT, mask_BT, global_normalization_factor=gvt
            )
        )

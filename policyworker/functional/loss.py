"""Pluggable training losses by their NeMo-RL names: NLL here, the clipped policy gradient
(``pg_loss``), DPO (``dpo_loss``), the contract (``loss_protocol``) and the configs
(``loss_options``). All functions are pure.

Shape legend: ``B`` batch rows, ``S`` padded sequence length, ``T`` = ``S - 1`` next-token
positions. The worker passes everything by keyword::

    loss, metrics = loss_fn(data=mb, global_valid_seqs=gvs, global_valid_toks=gvt,
                            next_token_logprobs=lp_BT)

``data`` holds [B, S] per-token tensors (``token_mask``, ``advantages``, ``prev_logprobs``, ...)
and ``sample_mask`` [B]; every per-token tensor is sliced ``[:, 1:]`` so that index ``t`` lines
up with ``next_token_logprobs[:, t]`` (the logprob of token ``t + 1``). ``global_valid_seqs`` /
``global_valid_toks`` are the counts over the whole global batch (all microbatches and
data-parallel ranks): every loss and additive metric is divided by them, so summing a global
batch's microbatch losses (or metrics) gives the global-batch mean (docs/custom-loss.md).
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torch import Tensor

from policyworker.functional.dpo_loss import DPOLossFn
from policyworker.functional.loss_inputs import logprobs_input, masks_from_data
from policyworker.functional.loss_options import ClippedPGConfig, DPOConfig
from policyworker.functional.loss_protocol import (
    LossFunction,
    LossInputType,
    LossType,
    MetricNormalizer,
    Metrics,
)
from policyworker.functional.loss_terms import kl_estimate, masked_mean, sanitize
from policyworker.functional.pg_loss import ClippedPGLossFn

__all__ = [
    "ClippedPGConfig",
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOConfig",
    "DPOLossConfig",
    "DPOLossFn",
    "LossFunction",
    "LossInputType",
    "LossType",
    "MetricNormalizer",
    "NLLLoss",
    "NLLLossFn",
    "calculate_kl",
    "masked_mean",
]


class NLLLoss:
    """Negative log-likelihood: ``−Σ(logprob · mask) / global_valid_toks``."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB
    required_keys = ("token_mask", "sample_mask")  # the batch keys this loss reads
    metric_normalizations: Mapping[str, MetricNormalizer] = MappingProxyType(
        {
            "loss": MetricNormalizer.TOKENS,
            "num_unmasked_tokens": MetricNormalizer.NONE,
            "num_valid_samples": MetricNormalizer.NONE,
        }
    )

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        **inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """Token-level NLL over ``token_mask[:, 1:] · sample_mask``."""
        logprobs_BT = logprobs_input(inputs, "NLLLoss")
        _, sample_mask_B, mask_BT = masks_from_data(data, logprobs_BT, "NLLLoss")
        logprobs_BT = sanitize(logprobs_BT, mask_BT != 0)
        loss = -masked_mean(logprobs_BT, mask_BT, global_normalization_factor=global_valid_toks)
        return loss, {
            "loss": float(loss.detach()),
            "num_unmasked_tokens": float(mask_BT.sum()),
            "num_valid_samples": float(sample_mask_B.sum()),
        }


NLLLossFn = NLLLoss  # NeMo-RL's name


def calculate_kl(
    logprobs: Tensor,
    logprobs_reference: Tensor,
    kl_type: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
    importance_sampling_weights: Tensor | None = None,
) -> Tensor:
    """NeMo-RL's per-token KL estimate (its signature and defaults), on `kl_estimate`."""
    if kl_type not in ("k1", "k2", "k3"):
        msg = f"kl_type {kl_type!r} must be 'k1', 'k2' or 'k3'"
        raise ValueError(msg)
    return kl_estimate(
        logprobs,
        logprobs_reference,
        kl_type=kl_type,  # type: ignore[arg-type]
        input_clamp=input_clamp_value,
        output_clamp=output_clamp_value,
        weights_BT=importance_sampling_weights,
    )


ClippedPGLossConfig = ClippedPGConfig  # NeMo-RL's names
DPOLossConfig = DPOConfig

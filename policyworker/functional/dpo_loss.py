"""Direct Preference Optimization over interleaved (chosen, rejected) rows, NeMo-RL style.

Shape legend: ``B`` rows (even: chosen, odd: rejected), ``S`` padded length, ``T = S - 1``. All
functions are pure.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from policyworker.functional.loss_inputs import logprobs_input, masks_from_data, next_token_slice
from policyworker.functional.loss_options import DPOConfig
from policyworker.functional.loss_protocol import (
    LossInputType,
    LossType,
    MetricNormalizer,
    Metrics,
)
from policyworker.functional.loss_terms import masked_mean, sanitize

__all__ = ["DPOLossFn"]


class DPOLossFn:
    """Direct Preference Optimization (+ optional SFT on the chosen rows), NeMo-RL style.

    Rows are interleaved pairs: even rows chosen, odd rows rejected. With ``lp`` the policy's and
    ``ref`` the reference's next-token logprobs and ``m = token_mask[:, 1:] · sample_mask``::

        r_i        = Σ_t (lp − ref)·m       (÷ Σ_t m if preference_average_log_probs)
        preference = Σ_pairs −log σ(β (r_chosen − r_rejected)) · sample_mask_chosen / (gvs / 2)
        sft        = Σ_chosen −Σ_t lp·m    (÷ Σ_t m if sft_average_log_probs)        / (gvs / 2)
        loss       = preference_loss_weight · preference + sft_loss_weight · sft

    Two deliberate differences from NeMo-RL: ``reference_policy_logprobs`` follows the worker's
    logprob convention ([B, S], index 0 = 0) and is sliced ``[:, 1:]`` like every other per-token
    tensor (NeMo-RL rolls it left and slices ``[:, :-1]``); and the rewards mask includes
    ``sample_mask``, so a masked row contributes neither a reward nor a gradient (the same as
    NeMo-RL unless a pair's rejected row is masked while its chosen row is not). ``sft_loss`` is
    reported even when its weight is 0 (NeMo-RL reports 0 then).
    """

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB

    required_keys = ("token_mask", "sample_mask", "reference_policy_logprobs")
    # every mean is over the global batch's pairs (global_valid_seqs / 2)
    metric_normalizations: Mapping[str, MetricNormalizer] = MappingProxyType(
        {
            "loss": MetricNormalizer.SEQUENCES,
            "sft_loss": MetricNormalizer.SEQUENCES,
            "preference_loss": MetricNormalizer.SEQUENCES,
            "accuracy": MetricNormalizer.SEQUENCES,
            "rewards_chosen_mean": MetricNormalizer.SEQUENCES,
            "rewards_rejected_mean": MetricNormalizer.SEQUENCES,
            "num_valid_samples": MetricNormalizer.NONE,
        }
    )

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = DPOConfig.from_mapping(cfg)

    @property
    def reference_policy_kl_penalty(self) -> float:
        """β of the preference term."""
        return self.cfg.reference_policy_kl_penalty

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        **inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """DPO loss of one microbatch of whole (chosen, rejected) pairs (rows 2i, 2i + 1)."""
        owner, cfg = "DPOLossFn", self.cfg
        lp_BT = logprobs_input(inputs, owner)
        if lp_BT.shape[0] % 2 != 0:
            msg = (
                f"{owner}: batch has {lp_BT.shape[0]} rows; DPO rows are (chosen, rejected) "
                f"pairs, so a microbatch must hold an even number of rows"
            )
            raise ValueError(msg)
        _, sample_mask_B, mask_BT = masks_from_data(data, lp_BT, owner)
        ref_BT = next_token_slice(data, "reference_policy_logprobs", lp_BT, owner)
        rewards_B, sft_B = self._row_terms(lp_BT, ref_BT, mask_BT)
        pairs = global_valid_seqs / 2
        chosen_mask, rejected_mask = sample_mask_B[0::2], sample_mask_B[1::2]
        r_chosen, r_rejected = rewards_B[0::2], rewards_B[1::2]
        per_pair = -torch.nn.functional.logsigmoid(
            cfg.reference_policy_kl_penalty * (r_chosen - r_rejected)
        )
        preference = masked_mean(per_pair, chosen_mask, global_normalization_factor=pairs)
        sft = masked_mean(sft_B[0::2], chosen_mask, global_normalization_factor=pairs)
        loss = cfg.preference_loss_weight * preference + cfg.sft_loss_weight * sft
        with torch.no_grad():
            return loss, {
                "loss": float(loss.detach()),
                "sft_loss": float(sft.detach()),
                "preference_loss": float(preference.detach()),
                "accuracy": float(
                    masked_mean(
                        (r_chosen > r_rejected).to(lp_BT.dtype),
                        chosen_mask,
                        global_normalization_factor=pairs,
                    )
                ),
                "rewards_chosen_mean": float(
                    masked_mean(r_chosen, chosen_mask, global_normalization_factor=pairs)
                ),
                "rewards_rejected_mean": float(
                    masked_mean(r_rejected, rejected_mask, global_normalization_factor=pairs)
                ),
                "num_valid_samples": float(sample_mask_B.sum()) / 2,
            }

    def _row_terms(self, lp_BT: Tensor, ref_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
        """Per-row implicit reward Σ(lp − ref)·m and SFT NLL −Σ lp·m (each optionally ÷ Σ m)."""
        keep_BT = mask_BT != 0
        lp_BT, ref_BT = sanitize(lp_BT, keep_BT), sanitize(ref_BT, keep_BT)
        num_tokens_B = mask_BT.sum(-1).clamp(min=1)
        rewards_B = ((lp_BT - ref_BT) * mask_BT).sum(-1)
        if self.cfg.preference_average_log_probs:
            rewards_B = rewards_B / num_tokens_B
        sft_B = -(lp_BT * mask_BT).sum(-1)
        if self.cfg.sft_average_log_probs:
            sft_B = sft_B / num_tokens_B
        return rewards_B, sft_B

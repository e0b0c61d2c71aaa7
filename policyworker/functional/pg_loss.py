"""The clipped policy-gradient loss (GRPO / PPO / GSPO / CISPO / REINFORCE) with its reference KL.

Shape legend: ``B`` rows, ``S`` padded length, ``T = S - 1`` next-token positions; every
per-token tensor is sliced ``[:, 1:]`` to line up with ``next_token_logprobs``. All functions are
pure.
"""

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from policyworker.functional.loss_inputs import (
    logprobs_input,
    masks_from_data,
    next_token_slice,
    require_tensor,
)
from policyworker.functional.loss_options import ClippedPGConfig
from policyworker.functional.loss_protocol import (
    LossInputType,
    LossType,
    MetricNormalizer,
    Metrics,
)
from policyworker.functional.loss_terms import (
    approx_entropy,
    kl_estimate,
    masked_mean,
    mismatch_metrics,
    ratio_metrics,
    rowwise_masked_mean,
    sanitize,
    truncate_importance_weights,
)
from policyworker.functional.staleness import fresh_token_mask, version_lag

__all__ = ["ClippedPGLossFn"]


class ClippedPGLossFn:
    """GRPO / PPO / GSPO / CISPO / REINFORCE clipped policy-gradient loss with a reference KL.

    ``cfg`` is NeMo-RL's ``loss_fn`` mapping (see ``ClippedPGConfig`` for keys and defaults).
    Per token (index ``t`` of the ``[:, 1:]`` slices, ``mask = token_mask · sample_mask``)::

        ratio      = exp(curr − prev)            (GSPO: one exp(mean_t(curr − prev)) per row)
        clip_loss  = max(−A·ratio, −A·clamp(ratio, 1 − ε_min, 1 + ε_max))
        dual clip  : where A < 0, min(clip_loss, −A·c)
        actor loss = masked_mean(w · clip_loss)   (w: importance weights, 1 unless enabled)
        kl         = β · k{1,2,3}(curr_unfiltered, ref) weighted by exp(curr − sg(curr))
                     (value 1, keeps the score-function gradient) or exp(curr − gen)
        loss       = actor loss + kl (+ μ · NLL on rows with reward > 0)

    Token level divides by ``global_valid_toks``; sequence level takes each row's token mean and
    divides by ``global_valid_seqs``. ``is_oob_ratio`` is reported when a truncation type is set.

    Deliberate differences from NeMo-RL, each so that microbatch losses and metrics sum to the
    global-batch value: the VAPO positive-example NLL is divided by ``global_valid_toks`` (NeMo-RL
    divides by the microbatch's own count of correct tokens); with sequence-level importance
    ratios, ``sampling_importance_ratio`` is the sample-masked mean of the per-row weights
    (NeMo-RL broadcasts [B, 1] against [B]). Positions where ``token_mask · sample_mask`` is 0
    are zeroed before any arithmetic, so garbage there (even ±inf) cannot reach loss or gradient.
    """

    input_type = LossInputType.LOGPROB

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = ClippedPGConfig.from_mapping(cfg)
        self.loss_type = (
            LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        )

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        """The global count each returned metric is divided by (see MetricNormalizer), from the
        same flags that pick it in ``__call__``. ``positive_nll_loss`` is divided by
        ``global_valid_toks`` here (NeMo-RL: the microbatch's own count, so NONE there)."""
        tokens, seqs, none = (
            MetricNormalizer.TOKENS,
            MetricNormalizer.SEQUENCES,
            MetricNormalizer.NONE,
        )
        like_grad = tokens if self.loss_type == LossType.TOKEN_LEVEL else seqs
        result = {
            "loss": like_grad,
            "kl_penalty": like_grad,
            "probs_ratio": tokens,
            "probs_ratio_clamped": tokens,
            "token_mult_prob_error": tokens,
            "gen_kl_error": tokens,
            "policy_kl_error": tokens,
            "js_divergence_error": tokens,
            "approx_entropy": tokens,
            "sampling_importance_ratio": (
                seqs if self.cfg.sequence_level_importance_ratios else tokens
            ),
            "positive_nll_loss": tokens,
            "num_valid_samples": none,
            "probs_ratio_min": none,
            "probs_ratio_max": none,
            "probs_ratio_clamped_min": none,
            "probs_ratio_clamped_max": none,
        }
        kind = self.cfg.truncated_importance_sampling_type
        if kind is not None:
            result["is_oob_ratio"] = seqs if kind == "seq-mask-tis" else tokens
        return result

    @property
    def reference_policy_kl_penalty(self) -> float:
        """β actually applied (0 when ``use_kl_in_reward`` moves the KL into the reward)."""
        return 0.0 if self.cfg.use_kl_in_reward else self.cfg.reference_policy_kl_penalty

    @property
    def required_keys(self) -> tuple[str, ...]:
        """The batch keys this loss reads with its config (the worker checks them all at once)."""
        keys = ["token_mask", "sample_mask", "advantages", "generation_logprobs"]
        if not self.cfg.force_on_policy_ratio:
            keys.append("prev_logprobs")
        if self.reference_policy_kl_penalty != 0:
            keys.append("reference_policy_logprobs")
        if self.cfg.max_version_lag is not None:
            keys.append("generation_versions")
        return tuple(keys)

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        **inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """Loss and metrics of one microbatch (metrics pre-divided by the global counts)."""
        x = _PGInputs.read(self, data, logprobs_input(inputs, "ClippedPGLossFn"))
        ratios_BT, clamped_BT = self._ratios(x)
        clip_loss_BT = self._clip_loss(x, ratios_BT, clamped_BT)
        weights, is_metrics = self._importance_weights(x, global_valid_seqs, global_valid_toks)
        used = weights if self.cfg.use_importance_sampling_correction else torch.ones_like(weights)
        actor_loss = self._reduce(x, used * clip_loss_BT, global_valid_seqs, global_valid_toks)
        kl = self._kl(x, global_valid_seqs, global_valid_toks)
        nll = self._positive_nll(x, data, global_valid_toks)
        loss = actor_loss + kl + self.cfg.positive_example_nll_weight * nll
        metrics = mismatch_metrics(
            x.prev_BT,
            x.gen_BT,
            x.mask_BT,
            kl_type=self.cfg.reference_policy_kl_type,
            gvt=global_valid_toks,
        )
        metrics |= ratio_metrics(ratios_BT, clamped_BT, x.mask_BT, global_valid_toks)
        metrics |= is_metrics
        beta = self.reference_policy_kl_penalty
        metrics |= {
            "loss": float(loss.detach()),
            "kl_penalty": float(kl.detach()) / beta if beta != 0 else 0.0,
            "sampling_importance_ratio": self._sampling_ratio(
                x, weights, global_valid_seqs, global_valid_toks
            ),
            "num_valid_samples": float(x.sample_mask_B.sum()),
            "approx_entropy": approx_entropy(x.curr_BT, x.gen_BT, x.mask_BT, global_valid_toks),
            "positive_nll_loss": float(nll.detach()),
        }
        return loss, metrics

    def _ratios(self, x: "_PGInputs") -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        if cfg.force_on_policy_ratio:
            ratios_BT = torch.exp(x.curr_BT - x.curr_BT.detach())
            return ratios_BT, ratios_BT
        if cfg.disable_ppo_ratio:
            return x.curr_BT, x.curr_BT
        log_ratio_BT = x.curr_BT - x.prev_BT
        if cfg.sequence_level_importance_ratios:
            seq_ratio_B = torch.exp(rowwise_masked_mean(log_ratio_BT, x.token_mask_BT))
            ratios_BT = seq_ratio_B[:, None].expand_as(log_ratio_BT)
        else:
            ratios_BT = torch.exp(log_ratio_BT)
        return ratios_BT, ratios_BT.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

    def _clip_loss(self, x: "_PGInputs", ratios_BT: Tensor, clamped_BT: Tensor) -> Tensor:
        if self.cfg.use_cispo:
            return -x.advantages_BT * clamped_BT.detach() * x.curr_BT
        clip_loss_BT = torch.maximum(-x.advantages_BT * ratios_BT, -x.advantages_BT * clamped_BT)
        if self.cfg.ratio_clip_c is not None:
            dual_BT = torch.minimum(clip_loss_BT, -x.advantages_BT * self.cfg.ratio_clip_c)
            clip_loss_BT = torch.where(x.advantages_BT < 0, dual_BT, clip_loss_BT)
        return clip_loss_BT

    def _importance_weights(
        self, x: "_PGInputs", gvs: Tensor | float, gvt: Tensor | float
    ) -> tuple[Tensor, Metrics]:
        """exp(prev − gen) per token ([B, T]) or exp(Σ_t (prev − gen)) per row ([B, 1])."""
        cfg = self.cfg
        log_is_BT = x.prev_BT.detach() - x.gen_BT
        if cfg.sequence_level_importance_ratios:
            weights = torch.exp((log_is_BT * x.mask_BT).sum(-1, keepdim=True))
        else:
            weights = torch.exp(log_is_BT)
        weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        if cfg.truncated_importance_sampling_type is None:
            return weights, {}
        assert cfg.truncated_importance_sampling_ratio is not None
        finite_log_is_BT = torch.nan_to_num(log_is_BT, nan=0.0, posinf=0.0, neginf=0.0)
        seq_mean_B = rowwise_masked_mean(finite_log_is_BT, x.token_mask_BT)
        return truncate_importance_weights(
            weights,
            kind=cfg.truncated_importance_sampling_type,
            ratio_max=cfg.truncated_importance_sampling_ratio,
            ratio_min=cfg.truncated_importance_sampling_ratio_min,
            seq_log_ratio_mean_B=seq_mean_B,
            mask_BT=x.mask_BT,
            sample_mask_B=x.sample_mask_B,
            global_valid_toks=gvt,
            global_valid_seqs=gvs,
        )

    def _reduce(
        self, x: "_PGInputs", values_BT: Tensor, gvs: Tensor | float, gvt: Tensor | float
    ) -> Tensor:
        if self.loss_type == LossType.TOKEN_LEVEL:
            return masked_mean(values_BT, x.mask_BT, global_normalization_factor=gvt)
        return masked_mean(
            rowwise_masked_mean(values_BT, x.token_mask_BT),
            x.sample_mask_B,
            global_normalization_factor=gvs,
        )

    def _kl(self, x: "_PGInputs", gvs: Tensor | float, gvt: Tensor | float) -> Tensor:
        beta = self.reference_policy_kl_penalty
        if beta == 0:
            return torch.zeros((), dtype=x.curr_BT.dtype, device=x.curr_BT.device)
        assert x.ref_BT is not None and x.curr_unfiltered_BT is not None
        curr_BT = x.curr_unfiltered_BT
        sampler_BT = x.gen_BT if self.cfg.use_on_policy_kl_approximation else curr_BT.detach()
        weights_BT = torch.nan_to_num(torch.exp(curr_BT - sampler_BT), 0.0, 0.0, 0.0)
        kl_BT = beta * kl_estimate(
            curr_BT,
            x.ref_BT,
            kl_type=self.cfg.reference_policy_kl_type,
            input_clamp=self.cfg.kl_input_clamp_value,
            output_clamp=self.cfg.kl_output_clamp_value,
            weights_BT=weights_BT,
        )
        return self._reduce(x, kl_BT, gvs, gvt)

    def _positive_nll(self, x: "_PGInputs", data: Mapping[str, Any], gvt: Tensor | float) -> Tensor:
        """VAPO term: NLL on rows whose reward is > 0, divided by ``global_valid_toks``."""
        if self.cfg.positive_example_nll_weight == 0:
            return torch.zeros((), dtype=x.curr_BT.dtype, device=x.curr_BT.device)
        owner = "ClippedPGLossFn (positive_example_nll_weight > 0)"
        rewards_B = require_tensor(data, "rewards", owner)
        correct_BT = x.mask_BT * (rewards_B.reshape(-1) > 0).to(x.mask_BT.dtype)[:, None]
        return masked_mean(-x.curr_BT, correct_BT, global_normalization_factor=gvt)

    def _sampling_ratio(
        self, x: "_PGInputs", weights: Tensor, gvs: Tensor | float, gvt: Tensor | float
    ) -> float:
        if self.cfg.sequence_level_importance_ratios:
            return float(
                masked_mean(
                    weights[:, 0].detach(), x.sample_mask_B, global_normalization_factor=gvs
                )
            )
        return float(masked_mean(weights.detach(), x.mask_BT, global_normalization_factor=gvt))


@attrs.frozen(kw_only=True)
class _PGInputs:
    """The [:, 1:]-aligned tensors of one ClippedPG call, zeroed where ``mask_BT`` is 0."""

    # Shape-suffix names (_BT, _B) are the house convention (STYLE), hence the N815 noqa.
    curr_BT: Tensor  # noqa: N815
    prev_BT: Tensor  # noqa: N815
    gen_BT: Tensor  # noqa: N815
    advantages_BT: Tensor  # noqa: N815
    token_mask_BT: Tensor  # noqa: N815
    sample_mask_B: Tensor  # noqa: N815
    mask_BT: Tensor  # noqa: N815
    ref_BT: Tensor | None  # noqa: N815
    curr_unfiltered_BT: Tensor | None  # noqa: N815

    @classmethod
    def read(
        cls, loss_fn: ClippedPGLossFn, data: Mapping[str, Any], curr_BT: Tensor
    ) -> "_PGInputs":
        owner = "ClippedPGLossFn"
        token_mask_BT, sample_mask_B, mask_BT = masks_from_data(data, curr_BT, owner)
        if loss_fn.cfg.max_version_lag is not None:
            fresh_BT = _fresh_tokens(data, curr_BT, int(loss_fn.cfg.max_version_lag), owner)
            token_mask_BT, mask_BT = token_mask_BT * fresh_BT, mask_BT * fresh_BT
        keep_BT = mask_BT != 0

        def per_token(key: str) -> Tensor:
            return sanitize(next_token_slice(data, key, curr_BT, owner), keep_BT)

        curr_BT = sanitize(curr_BT, keep_BT)
        force = loss_fn.cfg.force_on_policy_ratio
        prev_BT = curr_BT.detach() if force else per_token("prev_logprobs")
        ref_BT = curr_unf_BT = None
        if loss_fn.reference_policy_kl_penalty != 0:
            ref_BT, curr_unf_BT = per_token("reference_policy_logprobs"), curr_BT
            if "curr_logprobs_unfiltered" in data:
                unfiltered_BT = require_tensor(data, "curr_logprobs_unfiltered", owner)
                if unfiltered_BT.shape != curr_BT.shape:
                    msg = (
                        f"{owner}: data['curr_logprobs_unfiltered'] has shape "
                        f"{tuple(unfiltered_BT.shape)}, expected {tuple(curr_BT.shape)} "
                        f"(the shape of next_token_logprobs)"
                    )
                    raise ValueError(msg)
                curr_unf_BT = sanitize(unfiltered_BT.to(curr_BT.dtype), keep_BT)
        return cls(
            curr_BT=curr_BT,
            prev_BT=prev_BT,
            gen_BT=per_token("generation_logprobs"),
            advantages_BT=per_token("advantages"),
            token_mask_BT=token_mask_BT,
            sample_mask_B=sample_mask_B,
            mask_BT=mask_BT,
            ref_BT=ref_BT,
            curr_unfiltered_BT=curr_unf_BT,
        )


def _fresh_tokens(data: Mapping[str, Any], curr_BT: Tensor, max_lag: int, owner: str) -> Tensor:
    """[B, T]: 1 where the token's version lag is at most ``max_lag`` (the worker fills
    ``policy_version``; a direct caller passes it, one version per row)."""
    versions_BS = require_tensor(data, "generation_versions", owner)
    policy_B = require_tensor(data, "policy_version", owner)
    B, T = curr_BT.shape
    if tuple(versions_BS.shape) != (B, T + 1) or tuple(policy_B.shape) != (B,):
        msg = (
            f"{owner}: data['generation_versions'] must be {(B, T + 1)} and "
            f"data['policy_version'] {(B,)}, got {tuple(versions_BS.shape)} and "
            f"{tuple(policy_B.shape)}"
        )
        raise ValueError(msg)
    lag_BT = version_lag(versions_BS, policy_B)[:, 1:]
    return fresh_token_mask(lag_BT.to(curr_BT.device), max_lag, curr_BT)

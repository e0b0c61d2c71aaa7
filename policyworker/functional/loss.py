"""Pluggable training losses: the protocol, NLL, clipped policy gradient (GRPO/PPO) and DPO.

All functions are pure. Shape legend: ``B`` batch rows, ``S`` padded sequence length, ``T`` =
``S - 1`` next-token positions. The worker passes everything by keyword::

    loss, metrics = loss_fn(data=mb, global_valid_seqs=gvs, global_valid_toks=gvt,
                            next_token_logprobs=lp_BT)

``data`` holds [B, S] per-token tensors (``token_mask``, ``advantages``, ``prev_logprobs``, ...)
and ``sample_mask`` [B]; every per-token tensor is sliced ``[:, 1:]`` so that index ``t`` lines
up with ``next_token_logprobs[:, t]`` (the logprob of token ``t + 1``). ``global_valid_seqs`` /
``global_valid_toks`` are the counts over the whole global batch (all microbatches and
data-parallel ranks): every loss and additive metric is divided by them, so summing a global
batch's microbatch losses (or metrics) gives the global-batch mean.

Why it is over 400 lines: it is the table of NeMo-RL's losses, one class each (NLL, clipped
policy gradient with its KL and importance-sampling options, DPO), and each ``__call__`` reads
as one formula from inputs to ``(loss, metrics)``; the per-token terms they share already live
in ``loss_terms``, so what remains would not split without cutting a formula in two.
"""

import enum
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from policyworker.functional.loss_terms import (
    ClippedPGConfig,
    DPOConfig,
    approx_entropy,
    kl_estimate,
    logprobs_input,
    masked_mean,
    masks_from_data,
    mismatch_metrics,
    next_token_slice,
    ratio_metrics,
    require_tensor,
    rowwise_masked_mean,
    sanitize,
    truncate_importance_weights,
)

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
    "NLLLoss",
    "NLLLossFn",
    "calculate_kl",
    "masked_mean",
]

Metrics = dict[str, float]


class LossType(enum.StrEnum):
    """How the loss is normalized: per valid token or per valid sequence."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(enum.StrEnum):
    """What the worker passes besides ``data`` (by keyword, as NeMo-RL does): LOGPROB
    ``next_token_logprobs`` [B, S-1]; LOGIT ``logits`` [B, S, V]; DISTILLATION
    ``student_topk_logprobs`` and ``teacher_topk_logprobs`` [B, S-1, K] and ``H_all`` [B, S-1]
    or None (see `policyworker.functional.distillation`)."""

    LOGPROB = "logprob"
    LOGIT = "logit"
    DISTILLATION = "distillation"


@runtime_checkable
class LossFunction(Protocol):
    """A loss the worker can train with (a NeMo-RL custom loss ports by changing imports)."""

    loss_type: LossType
    input_type: LossInputType

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor,
        global_valid_toks: Tensor,
        **inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """Return the globally normalized 0-d loss and metrics including ``num_valid_samples``."""
        ...


# ----------------------------------------------------------------------------------------- NLL


class NLLLoss:
    """Negative log-likelihood: ``−Σ(logprob · mask) / global_valid_toks``."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB
    required_keys = ("token_mask", "sample_mask")  # the batch keys this loss reads

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


# ---------------------------------------------------------------------- clipped policy gradient


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


# ----------------------------------------------------------------------------------------- DPO


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


ClippedPGLossConfig = ClippedPGConfig  # NeMo-RL's names
DPOLossConfig = DPOConfig

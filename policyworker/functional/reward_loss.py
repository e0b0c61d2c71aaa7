"""Pairwise Bradley-Terry loss for training a reward model with `train()` (NeMo-RL's RM loss).

All functions are pure. Shape legend: ``B`` batch rows (interleaved pairs: even rows chosen,
odd rows rejected, as NeMo-RL's RM and DPO data are), ``S`` padded sequence length.

A sequence-classification model's forward gives one score per token, ``logits`` [B, S, 1]; a
row's reward ``r`` is its score at its last real token (``input_lengths − 1``), the token
`PolicyWorker.score` reads. With ``sample_mask`` [B] and ``global_valid_seqs`` the valid rows of
the whole global batch (so ``global_valid_seqs / 2`` pairs)::

    loss = Σ_pairs −log σ(r_chosen − r_rejected) · sample_mask_chosen / (global_valid_seqs / 2)

Metrics, NeMo-RL's keys: ``loss``, ``accuracy`` (pairs with r_chosen > r_rejected),
``rewards_chosen_mean``, ``rewards_rejected_mean``, ``num_valid_samples`` (pairs), each
normalized like the loss, so summing them over a global batch's microbatches gives its mean.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from policyworker.functional.loss import LossInputType, LossType, MetricNormalizer
from policyworker.functional.loss_inputs import require_tensor
from policyworker.functional.loss_terms import masked_mean

__all__ = ["PreferenceLoss", "last_token_rewards", "preference_loss_terms"]


def last_token_rewards(scores_BS: Tensor, lengths_B: Tensor) -> Tensor:
    """Each row's score at its last real token (index ``lengths − 1``) [B], as float32.

    Raises:
        ValueError: a length is outside [1, S].
    """
    width = scores_BS.shape[1]
    if lengths_B.numel() and (int(lengths_B.min()) < 1 or int(lengths_B.max()) > width):
        msg = (
            f"input_lengths must lie in [1, {width}] (the padded width), got "
            f"[{int(lengths_B.min())}, {int(lengths_B.max())}]"
        )
        raise ValueError(msg)
    index_B1 = (lengths_B.to(torch.int64).to(scores_BS.device) - 1)[:, None]
    return scores_BS.float().gather(1, index_B1)[:, 0]


def preference_loss_terms(
    rewards_B: Tensor, sample_mask_B: Tensor, global_valid_seqs: Tensor | float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, accuracy, rewards_chosen_mean, rewards_rejected_mean) of interleaved pairs.

    Raises:
        ValueError: an odd number of rows (rows come in (chosen, rejected) pairs).
    """
    if rewards_B.shape[0] % 2 != 0:
        msg = (
            f"PreferenceLoss: {rewards_B.shape[0]} rows; rows are (chosen, rejected) pairs "
            f"(rows 2i, 2i + 1), so a microbatch holds an even number of rows"
        )
        raise ValueError(msg)
    pairs = global_valid_seqs / 2
    chosen, rejected = rewards_B[0::2], rewards_B[1::2]
    chosen_mask = sample_mask_B[0::2].to(rewards_B.dtype)
    rejected_mask = sample_mask_B[1::2].to(rewards_B.dtype)
    per_pair = -torch.nn.functional.logsigmoid(chosen - rejected)
    loss = masked_mean(per_pair, chosen_mask, global_normalization_factor=pairs)
    with torch.no_grad():
        wins = (chosen > rejected).to(rewards_B.dtype)
        accuracy = masked_mean(wins, chosen_mask, global_normalization_factor=pairs)
        chosen_mean = masked_mean(chosen, chosen_mask, global_normalization_factor=pairs)
        rejected_mean = masked_mean(rejected, rejected_mask, global_normalization_factor=pairs)
    return loss, accuracy, chosen_mean, rejected_mean


class PreferenceLoss:
    """Bradley-Terry reward-model loss over interleaved (chosen, rejected) rows (module doc).

    Train a reward model (``reward_model_cfg: {enabled: true}``) with
    ``worker.train(data, PreferenceLoss())``; ``data`` needs ``input_ids``, ``input_lengths``
    and ``sample_mask``, with each pair's two rows adjacent and whole in one microbatch
    (an even ``train_micro_batch_size``; no sequence packing or dynamic batching).
    """

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGIT
    required_keys = ("input_lengths", "sample_mask")
    # every mean is over the global batch's pairs (global_valid_seqs / 2)
    metric_normalizations: Mapping[str, MetricNormalizer] = MappingProxyType(
        {
            "loss": MetricNormalizer.SEQUENCES,
            "accuracy": MetricNormalizer.SEQUENCES,
            "rewards_chosen_mean": MetricNormalizer.SEQUENCES,
            "rewards_rejected_mean": MetricNormalizer.SEQUENCES,
            "num_valid_samples": MetricNormalizer.NONE,
        }
    )

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        **inputs: Tensor,
    ) -> tuple[Tensor, dict[str, float]]:
        """Loss of one microbatch of whole pairs, from per-token scores ``logits`` [B, S, 1]."""
        if (
            set(inputs) != {"logits"}
            or inputs["logits"].dim() != 3
            or inputs["logits"].shape[-1] != 1
        ):
            got = {k: tuple(v.shape) for k, v in inputs.items()}
            msg = (
                f"PreferenceLoss takes the keyword input logits [B, S, 1] (a reward model's "
                f"per-token scores: reward_model_cfg enabled with bradley_terry), got {got}"
            )
            raise ValueError(msg)
        scores_BS = inputs["logits"][..., 0]
        lengths_B = require_tensor(data, "input_lengths", "PreferenceLoss")
        sample_mask_B = require_tensor(data, "sample_mask", "PreferenceLoss")
        rewards_B = last_token_rewards(scores_BS, lengths_B)
        loss, accuracy, chosen, rejected = preference_loss_terms(
            rewards_B, sample_mask_B.to(rewards_B.device), global_valid_seqs
        )
        return loss, {
            "loss": float(loss.detach()),
            "accuracy": float(accuracy),
            "rewards_chosen_mean": float(chosen),
            "rewards_rejected_mean": float(rejected),
            "num_valid_samples": float(sample_mask_B.sum()) / 2,
        }

"""Properties of the pairwise Bradley-Terry reward-model loss (`functional.reward_loss`)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.loss import LossFunction, LossInputType, LossType
from policyworker.functional.reward_loss import (
    PreferenceLoss,
    last_token_rewards,
    preference_loss_terms,
)
from tests.property.strategies import SEEDS

F64 = torch.float64


def _pairs(seed: int, num_pairs: int, *, masked: bool):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(2 * num_pairs, generator=g, dtype=F64) * 3
    mask = (
        (torch.rand(2 * num_pairs, generator=g) > 0.3).to(F64)
        if masked
        else torch.ones(2 * num_pairs, dtype=F64)
    )
    mask[1::2] = mask[0::2]  # a pair is valid or not as a whole
    return rewards, mask


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, num_pairs=st.integers(1, 6))
def test_loss_is_the_mean_negative_log_sigmoid_of_the_reward_margin(seed, num_pairs):
    rewards, mask = _pairs(seed, num_pairs, masked=False)
    loss, accuracy, chosen, rejected = preference_loss_terms(rewards, mask, 2 * num_pairs)
    margins = [float(rewards[2 * i] - rewards[2 * i + 1]) for i in range(num_pairs)]
    expected = sum(math.log1p(math.exp(-m)) for m in margins) / num_pairs
    assert float(loss) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert float(accuracy) == pytest.approx(sum(m > 0 for m in margins) / num_pairs, abs=1e-7)
    assert float(chosen) == pytest.approx(float(rewards[0::2].mean()), abs=1e-7)
    assert float(rejected) == pytest.approx(float(rewards[1::2].mean()), abs=1e-7)


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, num_pairs=st.integers(1, 6), shift=st.floats(-50, 50))
def test_loss_ignores_a_common_shift_and_swapping_a_pair_adds_its_margin(seed, num_pairs, shift):
    """Bradley-Terry sees only differences; −log σ(x) − (−log σ(−x)) = −x."""
    rewards, mask = _pairs(seed, num_pairs, masked=True)
    gvs = float(mask.sum())
    base = preference_loss_terms(rewards, mask, gvs)[0]
    shifted = preference_loss_terms(rewards + shift, mask, gvs)[0]
    assert float(shifted) == pytest.approx(float(base), rel=1e-9, abs=1e-9)
    swapped = rewards.view(-1, 2).flip(1).reshape(-1)
    margin = float(((rewards[0::2] - rewards[1::2]) * mask[0::2]).sum())
    got = float(preference_loss_terms(swapped, mask, gvs)[0] - base)
    assert got == pytest.approx(margin / (gvs / 2 + 1e-8), rel=1e-6, abs=1e-7)


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS, sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_microbatch_losses_sum_to_the_global_batch_loss(seed, sizes):
    """With the global pair count as the normalizer, per-microbatch losses add up."""
    rewards, mask = _pairs(seed, sum(sizes), masked=True)
    gvs = float(mask.sum())
    whole = preference_loss_terms(rewards, mask, gvs)[0]
    parts, start = [], 0
    for pairs in sizes:
        rows = slice(start, start + 2 * pairs)
        parts.append(preference_loss_terms(rewards[rows], mask[rows], gvs)[0])
        start += 2 * pairs
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS, rows=st.integers(1, 6), width=st.integers(1, 9))
def test_last_token_rewards_read_the_score_at_each_rows_last_real_token(seed, rows, width):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, generator=g, dtype=F64)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    got = last_token_rewards(scores, lengths)
    assert got.dtype == torch.float32
    assert all(
        float(got[i]) == pytest.approx(float(scores[i, lengths[i] - 1])) for i in range(rows)
    )


def test_last_token_rewards_refuse_a_length_outside_the_row():
    with pytest.raises(ValueError, match=r"input_lengths must lie in \[1, 3\]"):
        last_token_rewards(torch.zeros(2, 3), torch.tensor([0, 3]))


def test_an_odd_row_count_is_refused_by_name():
    with pytest.raises(ValueError, match="3 rows; rows are \\(chosen, rejected\\) pairs"):
        preference_loss_terms(torch.zeros(3), torch.ones(3), 3)


def test_preference_loss_is_a_logit_loss_with_nemo_rls_metric_keys():
    loss_fn = PreferenceLoss()
    assert isinstance(loss_fn, LossFunction)
    assert loss_fn.input_type == LossInputType.LOGIT
    assert loss_fn.loss_type == LossType.SEQUENCE_LEVEL
    scores = torch.tensor([[0.0, 2.0, 9.0], [0.0, -1.0, 9.0]]).unsqueeze(-1).requires_grad_()
    data = {"input_lengths": torch.tensor([2, 2]), "sample_mask": torch.ones(2)}
    loss, metrics = loss_fn(data=data, global_valid_seqs=2.0, global_valid_toks=4.0, logits=scores)
    assert set(metrics) == {
        "loss",
        "accuracy",
        "rewards_chosen_mean",
        "rewards_rejected_mean",
        "num_valid_samples",
    }
    assert metrics["loss"] == pytest.approx(math.log1p(math.exp(-3.0)), rel=1e-6)
    assert metrics["accuracy"] == 1.0 and metrics["num_valid_samples"] == 1.0
    loss.backward()
    assert scores.grad is not None and bool((scores.grad[:, 2] == 0).all())  # padding: no grad
    with pytest.raises(ValueError, match=r"logits \[B, S, 1\]"):
        loss_fn(data=data, global_valid_seqs=2.0, global_valid_toks=4.0, logits=scores[..., 0])

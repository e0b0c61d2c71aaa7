"""Properties of policyworker.functional.tokens (which tokens count) and functional.fp8."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.fp8 import FP8_E4M3_MAX, fp8_e4m3_scale, kv_scales
from policyworker.functional.tokens import (
    counted_tokens,
    last_token_values,
    mask_within_lengths,
    valid_token_total,
)
from tests.property.strategies import SEEDS, right_padded_batches, seeded_randint, seeded_randn


def _masks(seed, B, S):
    token_mask_BS = seeded_randint(seed, 2, (B, S)).to(torch.float32)
    sample_mask_B = seeded_randint(seed + 1, 2, (B,)).to(torch.float32)
    return token_mask_BS, sample_mask_B


@given(right_padded_batches(), SEEDS)
def test_a_token_counts_iff_inside_its_length_and_both_masks(batch, seed):
    tokens_BS, lengths_B = batch
    B, S = tokens_BS.shape
    token_mask_BS, sample_mask_B = _masks(seed, B, S)
    got = counted_tokens(lengths_B, S, token_mask_BS, sample_mask_B)
    for b in range(B):
        for s in range(S):
            want = s < lengths_B[b] and token_mask_BS[b, s] != 0 and sample_mask_B[b] != 0
            assert bool(got[b, s]) == bool(want)
    # the masks are optional: leaving one out is the same as passing all ones
    assert torch.equal(
        counted_tokens(lengths_B, S, None, None),
        counted_tokens(lengths_B, S, torch.ones(B, S), torch.ones(B)),
    )


@given(right_padded_batches(), SEEDS)
def test_normalizer_counts_the_counted_next_tokens_of_a_0_1_mask(batch, seed):
    tokens_BS, lengths_B = batch
    B, S = tokens_BS.shape
    token_mask_BS, sample_mask_B = _masks(seed, B, S)
    before = token_mask_BS.clone()
    cut_BS = mask_within_lengths(token_mask_BS, lengths_B)
    assert torch.equal(token_mask_BS, before)  # inputs unmutated
    assert cut_BS.dtype == token_mask_BS.dtype
    counted_BS = counted_tokens(lengths_B, S, token_mask_BS, sample_mask_B)
    total = valid_token_total(S, cut_BS, sample_mask_B)
    assert float(total) == float(counted_BS[:, 1:].sum())
    assert float(valid_token_total(S, None, sample_mask_B)) == float(sample_mask_B.sum()) * S


@given(right_padded_batches(), SEEDS)
def test_last_token_values_read_position_length_minus_one(batch, seed):
    tokens_BS, lengths_B = batch
    values_BS = seeded_randn(seed, tuple(tokens_BS.shape))
    got_B = last_token_values(values_BS, lengths_B)
    for b, n in enumerate(lengths_B.tolist()):
        assert float(got_B[b]) == (float(values_BS[b, n - 1]) if n > 0 else 0.0)


@given(st.integers(1, 200), SEEDS, st.floats(0.01, 100.0), st.floats(0.5, 2.0))
def test_fp8_scale_maps_the_percentile_sample_to_448_over_margin(n, seed, percentile, margin):
    values_N = seeded_randn(seed, (n,)).abs()
    scale = fp8_e4m3_scale(values_N, percentile, margin)
    rank = max(1, math.ceil(percentile / 100.0 * n))
    kth = sorted(values_N.tolist())[rank - 1]
    assert scale == pytest.approx(max(kth, 1e-12) * margin / FP8_E4M3_MAX, rel=1e-6)
    # at most the percentile's share of samples lies above the chosen one
    assert sum(v > kth for v in values_N.tolist()) <= n - rank
    assert fp8_e4m3_scale(values_N, 100.0, 1.0) == pytest.approx(
        float(values_N.max()) / FP8_E4M3_MAX
    )


def test_fp8_scales_refuse_bad_arguments_and_floor_empty_samples():
    with pytest.raises(ValueError, match="percentile"):
        fp8_e4m3_scale(torch.ones(3), 0.0, 1.0)
    with pytest.raises(ValueError, match="margin"):
        fp8_e4m3_scale(torch.ones(3), 50.0, 0.0)
    assert fp8_e4m3_scale(torch.zeros(0), 50.0, 1.0) == 1e-12 / FP8_E4M3_MAX
    layers = kv_scales({("l1", "v"): torch.ones(2), ("l0", "k"): torch.ones(2) * 448}, 100, 1)
    assert list(layers) == ["l0", "l1"] and layers["l0"] == {"k_scale": 1.0}

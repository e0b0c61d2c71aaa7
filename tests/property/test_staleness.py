"""Properties of per-token weight versions: the lag, its statistics, the freshness mask, the
batch check, and ClippedPG's ``max_version_lag`` (one-version batches: today's loss, bit for
bit)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.errors import ConfigError, DataError
from policyworker.functional.batch_checks import counted_positions
from policyworker.functional.loss import ClippedPGLossFn
from policyworker.functional.staleness import (
    check_generation_versions,
    fresh_token_mask,
    token_versions,
    version_lag,
    version_lag_stats,
)
from tests.property.strategies import SEEDS
from tests.property.test_loss import pg_batches, pg_configs


def _versions(seed: int, B: int, S: int, newest: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, newest + 1, (B, S), generator=g)


@given(seed=SEEDS, B=st.integers(1, 5), S=st.integers(1, 7), policy=st.integers(0, 9))
def test_lag_is_policy_minus_version(seed, B, S, policy):
    versions = _versions(seed, B, S, policy)
    lag = version_lag(versions, torch.full((B,), policy))
    assert lag.dtype == torch.int64
    assert torch.equal(lag + versions, torch.full((B, S), policy))
    assert bool((lag >= 0).all())


@given(seed=SEEDS, B=st.integers(1, 5), S=st.integers(1, 7), bound=st.integers(0, 4))
def test_fresh_mask_keeps_exactly_the_lags_within_bound(seed, B, S, bound):
    lag = _versions(seed, B, S, 6)
    like = torch.zeros(B, S, dtype=torch.float64)
    fresh = fresh_token_mask(lag, bound, like)
    assert fresh.dtype == torch.float64
    assert torch.equal(fresh.bool(), lag <= bound)


@given(seed=SEEDS, B=st.integers(1, 5), S=st.integers(1, 7))
def test_lag_stats_match_a_python_loop(seed, B, S):
    g = torch.Generator().manual_seed(seed)
    lag = torch.randint(0, 5, (B, S), generator=g)
    counted = torch.rand(B, S, generator=g) < 0.6
    stats = version_lag_stats(lag, counted)
    kept = [int(lag[b, s]) for b in range(B) for s in range(S) if counted[b, s]]
    assert stats["version_lag_tokens"] == len(kept)
    assert stats["max_version_lag"] == (max(kept) if kept else 0.0)
    assert stats["mean_version_lag"] == pytest.approx(sum(kept) / len(kept) if kept else 0.0)


def _batch(B: int, S: int, versions: torch.Tensor, policy: int | None) -> dict:
    data = {
        "input_ids": torch.zeros(B, S, dtype=torch.int64),
        "input_lengths": torch.full((B,), S),
        "generation_versions": versions,
    }
    if policy is not None:
        data["policy_version"] = torch.full((B,), policy)
    return data


@given(seed=SEEDS, B=st.integers(1, 4), S=st.integers(2, 6), policy=st.integers(0, 5))
def test_check_accepts_versions_up_to_the_policy_and_refuses_newer(seed, B, S, policy):
    versions = _versions(seed, B, S, policy)
    check_generation_versions(_batch(B, S, versions, policy))
    check_generation_versions(_batch(B, S, versions, None))
    newer = versions.clone()
    newer[0, -1] = policy + 1
    with pytest.raises(DataError, match="newer than"):
        check_generation_versions(_batch(B, S, newer, policy))


@pytest.mark.parametrize(
    ("versions", "match"),
    [
        (torch.zeros(2, 3), "integer"),
        (torch.zeros(2, 3, dtype=torch.bool), "bool"),
        (torch.zeros(2, 4, dtype=torch.int64), "shaped like input_ids"),
    ],
)
def test_check_refuses_bad_versions(versions, match):
    with pytest.raises(DataError, match=match):
        check_generation_versions(_batch(2, 3, versions, None) | {"generation_versions": versions})


def test_check_refuses_a_policy_version_alone():
    data = _batch(2, 3, torch.zeros(2, 3, dtype=torch.int64), 1)
    del data["generation_versions"]
    with pytest.raises(DataError, match="without"):
        check_generation_versions(data)


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_max_version_lag_must_be_a_whole_number(bad):
    with pytest.raises(ConfigError, match="max_version_lag"):
        ClippedPGLossFn({"max_version_lag": bad})


@settings(max_examples=60, deadline=None)
@given(batch=pg_batches(), cfg=pg_configs(), bound=st.integers(0, 3), version=st.integers(0, 7))
def test_one_version_batch_is_todays_loss_bit_for_bit(batch, cfg, bound, version):
    data, lp = batch
    B, S = data["token_mask"].shape
    gvs = float(data["sample_mask"].sum()) or 1.0
    gvt = float((data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()) or 1.0
    today, today_metrics = ClippedPGLossFn(cfg)(data, gvs, gvt, next_token_logprobs=lp)
    versioned = data | {
        "generation_versions": torch.full((B, S), version),
        "policy_version": torch.full((B,), version),
    }
    loss, metrics = ClippedPGLossFn(cfg | {"max_version_lag": bound})(
        versioned, gvs, gvt, next_token_logprobs=lp
    )
    assert torch.equal(loss, today)
    assert metrics == today_metrics


@settings(max_examples=40, deadline=None)
@given(batch=pg_batches(), cfg=pg_configs(), bound=st.integers(0, 3), seed=SEEDS)
def test_stale_tokens_are_the_same_as_masked_tokens(batch, cfg, bound, seed):
    data, lp = batch
    B, S = data["token_mask"].shape
    versions = _versions(seed, B, S, 6)
    gvs, gvt = 3.0, 7.0
    versioned = data | {"generation_versions": versions, "policy_version": torch.full((B,), 6)}
    loss, _ = ClippedPGLossFn(cfg | {"max_version_lag": bound})(
        versioned, gvs, gvt, next_token_logprobs=lp
    )
    fresh = (6 - versions <= bound).to(data["token_mask"].dtype)
    masked = data | {"token_mask": data["token_mask"] * fresh}
    expected, _ = ClippedPGLossFn(cfg)(masked, gvs, gvt, next_token_logprobs=lp)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_loss_requires_the_versions_when_bounded():
    assert "generation_versions" in ClippedPGLossFn({"max_version_lag": 1}).required_keys
    assert "generation_versions" not in ClippedPGLossFn().required_keys


def test_counted_positions_is_what_the_lag_stats_read():
    data = _batch(1, 4, torch.tensor([[0, 1, 2, 3]]), 3) | {"input_lengths": torch.tensor([3])}
    lag = version_lag(data["generation_versions"], data["policy_version"])
    stats = version_lag_stats(lag, counted_positions(data))
    assert stats == {"max_version_lag": 2.0, "mean_version_lag": 1.5, "version_lag_tokens": 2.0}


@given(
    n=st.integers(0, 12),
    cuts=st.lists(st.integers(0, 14), max_size=4),
    initial=st.integers(0, 3),
)
def test_token_versions_follow_the_swaps_in_order(n, cuts, initial):
    swaps = [(cut, initial + k + 1) for k, cut in enumerate(sorted(cuts))]
    versions = token_versions(n, swaps, initial)
    assert len(versions) == n
    for i, version in enumerate(versions):
        applied = [v for cut, v in swaps if cut <= i]
        assert version == (applied[-1] if applied else initial)

"""Properties of the microbatch-metric reduction rules (reference §7.3-§7.4)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.loss import ClippedPGLossFn
from policyworker.functional.metrics import (
    aggregate_microbatch_metrics,
    combine_packed_sequence_metrics,
    flatten_train_metrics,
    metric_reduction,
    scale_microbatch_metrics,
)
from tests.property.strategies import SEEDS

EXTREME_KEYS = (
    "probs_ratio_min",
    "probs_ratio_max",
    "probs_ratio_clamped_min",
    "probs_ratio_clamped_max",
)
MEAN_KEYS = ("lr", "wd", "global_valid_seqs", "global_valid_toks")
SUM_KEYS = ("loss", "num_valid_samples", "kl_penalty", "accuracy", "is_oob_ratio")
ALL_KEYS = EXTREME_KEYS + MEAN_KEYS + SUM_KEYS

finite_values = st.floats(-1e6, 1e6, allow_nan=False)
extreme_values = st.one_of(finite_values, st.sampled_from([math.inf, -math.inf]))


def value_strategy(key):
    return extreme_values if "_min" in key or "_max" in key else finite_values


@st.composite
def metric_lists(draw, *, keys=None):
    """{key: [per-microbatch values]} with the same number of microbatches for every key."""
    if keys is None:
        keys = draw(st.lists(st.sampled_from(ALL_KEYS), min_size=1, unique=True))
    n = draw(st.integers(1, 6))
    return {k: draw(st.lists(value_strategy(k), min_size=n, max_size=n)) for k in keys}


@st.composite
def global_batches(draw):
    """1-4 global batches' metric lists, all with the same keys."""
    keys = draw(st.lists(st.sampled_from(ALL_KEYS), min_size=1, unique=True))
    return draw(st.lists(metric_lists(keys=keys), min_size=1, max_size=4))


def oracle(all_mb_metrics):
    """The reference §7.4 rule, written out key by key."""
    out = {}
    for key, values in all_mb_metrics.items():
        finite = [v for v in values if not math.isinf(v)]
        if key.endswith("_min"):
            out[key] = min(finite) if finite else -1.0
        elif key.endswith("_max"):
            out[key] = max(finite) if finite else -1.0
        elif key in MEAN_KEYS:
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(values)
    return out


@given(all_mb=metric_lists())
def test_aggregation_matches_the_hand_written_rule(all_mb):
    got = aggregate_microbatch_metrics(all_mb)
    expected = oracle(all_mb)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-6), key


def test_aggregation_hand_example():
    got = aggregate_microbatch_metrics(
        {
            "loss": [0.25, 0.5, -0.125],
            "probs_ratio_min": [math.inf, 0.75, 0.5],
            "probs_ratio_clamped_max": [-math.inf, -math.inf],
            "probs_ratio_max": [1.25, -math.inf, 1.5],
            "lr": [1e-5, 1e-5, 1e-5],
            "global_valid_toks": [10.0, 10.0, 12.0],
            "num_valid_samples": [2.0, 3.0, 0.0],
            "unused": [],
        }
    )
    assert got == pytest.approx(
        {
            "loss": 0.625,
            "probs_ratio_min": 0.5,
            "probs_ratio_clamped_max": -1.0,
            "probs_ratio_max": 1.5,
            "lr": 1e-5,
            "global_valid_toks": 32.0 / 3,
            "num_valid_samples": 5.0,
        }
    )


@given(
    metrics=st.fixed_dictionaries({k: value_strategy(k) for k in ALL_KEYS}),
    num_global_batches=st.integers(1, 8),
)
def test_scaling_divides_everything_but_the_extremes(metrics, num_global_batches):
    scaled = scale_microbatch_metrics(metrics, num_global_batches)
    assert scaled.keys() == metrics.keys()
    for key, value in metrics.items():
        if key in EXTREME_KEYS:
            assert scaled[key] == value
        else:
            assert scaled[key] == pytest.approx(value / num_global_batches)


@given(per_batch=global_batches())
def test_scaled_sums_over_global_batches_are_the_mean_of_per_batch_sums(per_batch):
    """Conservation: Σ_g Σ_mb scaled = mean_g Σ_mb, for every additive metric."""
    G = len(per_batch)
    everything = {key: [] for key in per_batch[0]}
    for batch in per_batch:
        n = len(next(iter(batch.values())))
        for i in range(n):
            scaled = scale_microbatch_metrics({k: v[i] for k, v in batch.items()}, G)
            for key, value in scaled.items():
                everything[key].append(value)
    got = aggregate_microbatch_metrics(everything)
    for key in everything:
        if metric_reduction(key) == "sum":
            expected = sum(sum(batch[key]) for batch in per_batch) / G
            assert got[key] == pytest.approx(expected, rel=1e-9, abs=1e-6), key


@given(
    per_sequence=st.lists(
        st.fixed_dictionaries({k: value_strategy(k) for k in EXTREME_KEYS + SUM_KEYS}),
        min_size=1,
        max_size=6,
    ),
    split=st.integers(0, 6),
)
def test_combining_packed_sequences_is_invariant_to_grouping(per_sequence, split):
    """combine(all) == combine([combine(head), combine(tail)]) — how packed losses nest."""
    head, tail = per_sequence[:split], per_sequence[split:]
    nested = combine_packed_sequence_metrics(
        [combine_packed_sequence_metrics(part) for part in (head, tail) if part]
    )
    flat = combine_packed_sequence_metrics(per_sequence)
    assert nested.keys() == flat.keys()
    for key in flat:
        assert nested[key] == pytest.approx(flat[key], rel=1e-9, abs=1e-6), key


def test_combining_packed_sequences_hand_example():
    got = combine_packed_sequence_metrics(
        [
            {"loss": 0.5, "probs_ratio_min": math.inf, "probs_ratio_max": -math.inf},
            {"loss": 0.25, "probs_ratio_min": 0.9, "probs_ratio_max": 1.1},
            {"loss": 0.25, "probs_ratio_min": 0.8, "probs_ratio_max": -math.inf},
        ]
    )
    assert got == {"loss": 1.0, "probs_ratio_min": 0.8, "probs_ratio_max": 1.1}
    empty = combine_packed_sequence_metrics([{"probs_ratio_clamped_min": math.inf}])
    assert empty == {"probs_ratio_clamped_min": math.inf}


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_scaling_rejects_a_non_positive_or_non_int_batch_count(bad):
    with pytest.raises(ValueError, match=r"num_global_batches must be a positive int"):
        scale_microbatch_metrics({"loss": 1.0}, bad)


@given(seed=SEEDS, num_microbatches=st.integers(1, 4))
@settings(max_examples=30)
def test_aggregated_microbatch_metrics_equal_the_whole_batch_metrics(seed, num_microbatches):
    """End to end: ClippedPG metrics of a split global batch aggregate to the unsplit ones."""
    g = torch.Generator().manual_seed(seed)
    B, S = 2 * num_microbatches, 5
    lp = -torch.rand(B, S - 1, generator=g, dtype=torch.float64) - 0.1
    data = {
        "token_mask": torch.ones(B, S, dtype=torch.float64),
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, S, generator=g, dtype=torch.float64),
        "prev_logprobs": torch.cat([torch.zeros(B, 1), lp + 0.3], 1).to(torch.float64),
        "generation_logprobs": torch.cat([torch.zeros(B, 1), lp], 1).to(torch.float64),
        "reference_policy_logprobs": torch.cat([torch.zeros(B, 1), lp - 0.2], 1),
    }
    gvs, gvt = torch.tensor(float(B)), torch.tensor(float(B * (S - 1)))
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.1})
    _, whole = loss_fn(
        data=data, global_valid_seqs=gvs, global_valid_toks=gvt, next_token_logprobs=lp
    )
    all_mb = {key: [] for key in whole}
    for part in torch.arange(B).chunk(num_microbatches):
        _, mb = loss_fn(
            data={k: v[part] for k, v in data.items()},
            global_valid_seqs=gvs,
            global_valid_toks=gvt,
            next_token_logprobs=lp[part],
        )
        for key, value in mb.items():
            all_mb[key].append(value)
    got = aggregate_microbatch_metrics(all_mb)
    for key, value in whole.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@given(
    all_mb=metric_lists(),
    losses=st.lists(finite_values, min_size=1, max_size=4),
    grad_norm=st.one_of(st.none(), finite_values),
    skipped=st.integers(0, 3),
    prefix=st.sampled_from(["", "train/"]),
)
def test_flattened_train_result_is_floats_only(all_mb, losses, grad_norm, skipped, prefix):
    result = {
        "global_loss": torch.tensor(losses, dtype=torch.float64),
        "grad_norm": grad_norm,
        "all_mb_metrics": all_mb,
        "rank": 0,
        "model_dtype": torch.bfloat16,
        "skipped_steps": skipped,
    }
    flat = flatten_train_metrics(result, prefix=prefix)
    assert all(type(v) is float for v in flat.values())
    assert all(k.startswith(prefix) for k in flat)
    unprefixed = {k.removeprefix(prefix): v for k, v in flat.items()}
    assert unprefixed["global_loss"] == pytest.approx(math.fsum(losses) / len(losses), abs=1e-6)
    assert unprefixed["skipped_steps"] == float(skipped)
    assert ("grad_norm" in unprefixed) == (grad_norm is not None)
    assert "rank" not in unprefixed and "model_dtype" not in unprefixed
    for key, value in aggregate_microbatch_metrics(all_mb).items():
        assert unprefixed[key] == value


@given(
    st.dictionaries(st.sampled_from(ALL_KEYS), finite_values, max_size=8),
    st.integers(0, 4096),
    st.integers(0, 64),
    st.booleans(),
)
def test_deferred_metrics_equal_metrics_computed_with_the_true_counts(raw, toks, seqs, per_token):
    """A metric summed with counts of 1, then normalized, equals the one a loss would report
    with the true counts: advertised ones by their count, extremes and `none` kept, the rest
    by the loss's normalizer."""
    from policyworker.functional.metrics import normalize_deferred_metrics

    advertised = {"loss": "tokens", "kl_penalty": "sequences", "num_valid_samples": "none"}
    out = normalize_deferred_metrics(
        raw, advertised, valid_toks=toks, valid_seqs=seqs, token_level=per_token
    )
    assert set(out) == set(raw)
    t, s = max(toks, 1), max(seqs, 1)
    for key, value in raw.items():
        if key in EXTREME_KEYS or key == "num_valid_samples":
            assert out[key] == value
        elif key == "loss":
            assert out[key] == value / t
        elif key == "kl_penalty":
            assert out[key] == value / s
        else:
            assert out[key] == value / (t if per_token else s)

"""Losses advertise `metric_normalizations` (NeMo-RL's attribute); metrics reduce by it."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.distillation import DistillationLossFn
from policyworker.functional.loss import (
    ClippedPGLossFn,
    DPOLossFn,
    MetricNormalizer,
    NLLLoss,
)
from policyworker.functional.loss_protocol import metric_normalizations_of
from policyworker.functional.metrics import (
    advertised_reductions,
    aggregate_microbatch_metrics,
    flatten_train_metrics,
    metric_reduction,
    scale_microbatch_metrics,
)
from policyworker.functional.reward_loss import PreferenceLoss
from tests.property.strategies import SEEDS

NORMALIZERS = st.sampled_from([*MetricNormalizer, None])
KEYS = st.sampled_from(["loss", "share_max", "ratio_min", "lr", "count", "x_min_y"])


@given(key=KEYS, normalizer=NORMALIZERS)
def test_a_globally_normalized_metric_sums_else_its_name_decides(key, normalizer):
    got = metric_reduction(key, normalizer)
    if normalizer in (MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES):
        assert got == "sum"
    else:
        assert got == metric_reduction(key)


@settings(max_examples=60)
@given(
    advertised=st.dictionaries(KEYS, st.sampled_from(list(MetricNormalizer)), max_size=4),
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=5),
    num_gb=st.integers(1, 4),
)
def test_reductions_override_the_name_rule_and_nothing_else(advertised, values, num_gb):
    reductions = advertised_reductions(advertised)
    all_mb = {key: list(values) for key in ("loss", "share_max", "ratio_min", "count")}
    got = aggregate_microbatch_metrics(all_mb, reductions=reductions)
    plain = aggregate_microbatch_metrics(all_mb)
    for key in all_mb:
        if key in reductions and reductions[key] != metric_reduction(key):
            assert got[key] == pytest.approx(math.fsum(values))
        else:
            assert got[key] == plain[key]
    one = {key: v[0] for key, v in all_mb.items()}
    scaled = scale_microbatch_metrics(one, num_gb, reductions=reductions)
    for key, value in one.items():
        kept = (reductions.get(key) or metric_reduction(key)) in ("min", "max")
        assert scaled[key] == (value if kept else value / num_gb)
    result = {"all_mb_metrics": all_mb, "metric_reductions": reductions}
    assert {k: v for k, v in flatten_train_metrics(result).items()} == got


def _pg_data(g, rows, length):
    lp = -torch.rand(rows, length - 1, generator=g, dtype=torch.float64) - 0.1
    zeros = torch.zeros(rows, 1, dtype=torch.float64)
    data = {
        "token_mask": torch.ones(rows, length, dtype=torch.float64),
        "sample_mask": torch.ones(rows, dtype=torch.float64),
        "advantages": torch.randn(rows, length, generator=g, dtype=torch.float64),
        "prev_logprobs": torch.cat([zeros, lp + 0.3], 1),
        "generation_logprobs": torch.cat([zeros, lp], 1),
        "reference_policy_logprobs": torch.cat([zeros, lp - 0.2], 1),
    }
    return data, lp


PG_CONFIGS = st.fixed_dictionaries(
    {
        "reference_policy_kl_penalty": st.sampled_from([0.0, 0.1]),
        "token_level_loss": st.booleans(),
        "sequence_level_importance_ratios": st.booleans(),
        "use_importance_sampling_correction": st.booleans(),
    }
)


@settings(max_examples=30)
@given(seed=SEEDS, cfg=PG_CONFIGS, tis=st.sampled_from([None, "tis", "icepop", "seq-mask-tis"]))
def test_every_metric_clipped_pg_returns_is_advertised(seed, cfg, tis):
    if cfg["sequence_level_importance_ratios"]:  # GSPO needs a sequence-level loss
        cfg = {**cfg, "token_level_loss": False}
    if tis == "seq-mask-tis":  # token-level weights only
        cfg = {**cfg, "sequence_level_importance_ratios": False}
    if tis is not None:
        cfg = {
            **cfg,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": tis,
            "truncated_importance_sampling_ratio": 2.0,
            "truncated_importance_sampling_ratio_min": 0.5,
        }
    loss_fn = ClippedPGLossFn(cfg)
    data, lp = _pg_data(torch.Generator().manual_seed(seed), 4, 5)
    _, metrics = loss_fn(
        data=data,
        global_valid_seqs=torch.tensor(4.0),
        global_valid_toks=torch.tensor(16.0),
        next_token_logprobs=lp,
    )
    norms = metric_normalizations_of(loss_fn)
    assert set(metrics) == set(norms)
    like_grad = MetricNormalizer.TOKENS if cfg["token_level_loss"] else MetricNormalizer.SEQUENCES
    assert norms["loss"] is like_grad and norms["kl_penalty"] is like_grad
    assert norms["probs_ratio_min"] is MetricNormalizer.NONE
    if tis is not None:
        want = MetricNormalizer.SEQUENCES if tis == "seq-mask-tis" else MetricNormalizer.TOKENS
        assert norms["is_oob_ratio"] is want


def test_every_other_loss_advertises_each_metric_it_returns():
    g = torch.Generator().manual_seed(0)
    data, lp = _pg_data(g, 4, 5)
    gvs, gvt = torch.tensor(4.0), torch.tensor(16.0)
    _, nll = NLLLoss()(
        data=data, global_valid_seqs=gvs, global_valid_toks=gvt, next_token_logprobs=lp
    )
    _, dpo = DPOLossFn()(
        data=data, global_valid_seqs=gvs, global_valid_toks=gvt, next_token_logprobs=lp
    )
    data_k = {
        **data,
        "teacher_topk_logits": torch.randn(4, 5, 3, generator=g),
        "teacher_topk_indices": torch.randint(0, 7, (4, 5, 3), generator=g),
    }
    distill_fn = DistillationLossFn()
    from policyworker.functional.distillation import distillation_loss_input

    _, distill = distill_fn(
        data=data_k,
        global_valid_seqs=gvs,
        global_valid_toks=gvt,
        **distillation_loss_input(torch.randn(4, 5, 7, generator=g), data_k, distill_fn),
    )
    rm_data = {"input_lengths": torch.tensor([5, 4, 3, 5]), "sample_mask": torch.ones(4)}
    _, rm = PreferenceLoss()(
        data=rm_data,
        global_valid_seqs=gvs,
        global_valid_toks=gvt,
        logits=torch.randn(4, 5, 1, generator=g),
    )
    for loss_fn, metrics in (
        (NLLLoss(), nll),
        (DPOLossFn(), dpo),
        (distill_fn, distill),
        (PreferenceLoss(), rm),
    ):
        assert set(metrics) == set(metric_normalizations_of(loss_fn)), type(loss_fn).__name__


def test_a_loss_without_the_attribute_keeps_the_name_rule_and_a_bad_one_is_refused():
    class Plain:
        pass

    assert metric_normalizations_of(Plain()) == {}
    assert advertised_reductions({}) == {}

    class Bad:
        metric_normalizations = {"loss": "per_row"}

    with pytest.raises(ValueError, match=r"Bad.metric_normalizations\['loss'\] is 'per_row'"):
        metric_normalizations_of(Bad())

    class NotAMapping:
        metric_normalizations = ["loss"]

    with pytest.raises(ValueError, match="expected a mapping"):
        metric_normalizations_of(NotAMapping())

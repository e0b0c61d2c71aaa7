"""Properties of the training losses: global normalization, hand values, closed forms, gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.errors import ConfigError
from policyworker.functional.loss import (
    ClippedPGLossFn,
    DPOLossFn,
    LossFunction,
    LossInputType,
    LossType,
    NLLLoss,
    masked_mean,
)
from policyworker.functional.loss_terms import kl_estimate, truncate_importance_weights
from policyworker.functional.metrics import combine_packed_sequence_metrics, metric_reduction
from tests.property.strategies import SEEDS

F64 = torch.float64
PER_TOKEN_KEYS = (
    "token_mask",
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
    "reference_policy_logprobs",
)


# ------------------------------------------------------------------------------- strategies


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=F64)


def _bits(g: torch.Generator, p: float, *shape: int) -> torch.Tensor:
    return (torch.rand(shape, generator=g, dtype=F64) < p).to(F64)


@st.composite
def pg_batches(draw, *, max_batch=6, max_len=8, even_rows=False):
    """(data, next_token_logprobs [B, S-1]); column 0 of per-token tensors is garbage on purpose."""
    B = draw(st.integers(1, max_batch // 2)) * 2 if even_rows else draw(st.integers(1, max_batch))
    S = draw(st.integers(2, max_len))
    g = torch.Generator().manual_seed(draw(SEEDS))
    mask_mode = draw(st.sampled_from(["random", "random", "random", "all_zero", "all_one"]))
    lp = -_randn(g, B, S - 1).abs() - 0.05
    prev = lp + 0.3 * _randn(g, B, S - 1)
    data = {
        "token_mask": {
            "random": _bits(g, 0.7, B, S),
            "all_zero": torch.zeros(B, S, dtype=F64),
            "all_one": torch.ones(B, S, dtype=F64),
        }[mask_mode],
        "sample_mask": _bits(g, 0.8, B) if mask_mode == "random" else torch.ones(B, dtype=F64),
        "advantages": _randn(g, B, S),
        "prev_logprobs": torch.cat([_randn(g, B, 1), prev], dim=1),
        "generation_logprobs": torch.cat([_randn(g, B, 1), prev + 0.3 * _randn(g, B, S - 1)], 1),
        "reference_policy_logprobs": torch.cat(
            [_randn(g, B, 1), lp + 0.3 * _randn(g, B, S - 1)], 1
        ),
        "rewards": _randn(g, B),
    }
    if draw(st.booleans()):
        data["curr_logprobs_unfiltered"] = lp + 0.1 * _randn(g, B, S - 1)
    return data, lp


@st.composite
def pg_configs(draw):
    """Valid ClippedPG configs covering every KL type, IS mode, loss level and ratio variant."""
    token_level = draw(st.booleans())
    gspo = not token_level and draw(st.booleans())
    variant = draw(st.sampled_from(["ppo", "ppo", "cispo", "reinforce", "on_policy"]))
    if variant == "cispo" and not token_level:
        variant = "ppo"
    use_is = draw(st.booleans())
    trunc = draw(st.sampled_from([None, "tis", "icepop", "seq-mask-tis"])) if use_is else None
    if trunc == "seq-mask-tis" and gspo:
        trunc = "icepop"
    cfg = {
        "reference_policy_kl_penalty": draw(st.sampled_from([0.0, 0.05, 0.5])),
        "reference_policy_kl_type": draw(st.sampled_from(["k1", "k2", "k3"])),
        "use_on_policy_kl_approximation": draw(st.booleans()),
        "ratio_clip_min": draw(st.sampled_from([0.1, 0.2])),
        "ratio_clip_max": draw(st.sampled_from([0.2, 0.28])),
        "ratio_clip_c": draw(st.sampled_from([None, 1.5, 3.0])) if variant != "cispo" else None,
        "token_level_loss": token_level,
        "sequence_level_importance_ratios": gspo,
        "use_importance_sampling_correction": use_is,
        "use_cispo": variant == "cispo",
        "disable_ppo_ratio": variant == "reinforce",
        "force_on_policy_ratio": variant == "on_policy",
        "positive_example_nll_weight": draw(st.sampled_from([0.0, 0.5])),
    }
    if trunc is not None:
        cfg |= {
            "truncated_importance_sampling_type": trunc,
            "truncated_importance_sampling_ratio": draw(st.sampled_from([1.05, 1.3, 2.0])),
            "truncated_importance_sampling_ratio_min": draw(st.sampled_from([0.5, 0.95])),
        }
    return cfg


@st.composite
def partitions(draw, n, *, group=1):
    """A random partition of range(n) into index lists, keeping aligned groups of `group` rows."""
    units = draw(st.permutations(range(n // group)))
    cuts = draw(st.lists(st.booleans(), min_size=len(units), max_size=len(units)))
    parts, current = [], []
    for unit, cut in zip(units, cuts, strict=True):
        current += [unit * group + k for k in range(group)]
        if cut:
            parts.append(current)
            current = []
    return [p for p in parts + [current] if p]


def global_counts(data):
    sample_mask = data["sample_mask"]
    gvs = sample_mask.sum()
    gvt = (data["token_mask"][:, 1:] * sample_mask[:, None]).sum()
    return gvs, gvt


def call(loss_fn, data, lp, gvs, gvt):
    return loss_fn(data=data, global_valid_seqs=gvs, global_valid_toks=gvt, next_token_logprobs=lp)


def rows(data, lp, index):
    idx = torch.tensor(index)
    return {k: v[idx] for k, v in data.items()}, lp[idx]


def assert_partition_invariant(loss_fn, data, lp, parts):
    """Microbatch losses (and metrics, combined by their rules) sum to the whole-batch values."""
    gvs, gvt = global_counts(data)
    whole_loss, whole_metrics = call(loss_fn, data, lp, gvs, gvt)
    results = [call(loss_fn, *rows(data, lp, p), gvs, gvt) for p in parts]
    summed = torch.stack([loss for loss, _ in results]).sum()
    torch.testing.assert_close(summed, whole_loss, rtol=1e-5, atol=1e-9)
    combined = combine_packed_sequence_metrics([m for _, m in results])
    assert combined.keys() == whole_metrics.keys()
    for key, value in whole_metrics.items():
        if metric_reduction(key) in ("min", "max") and math.isinf(value):
            assert math.isinf(combined[key]), key
        else:
            assert combined[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


# -------------------------------------------------------------------- global normalization


@given(batch=pg_batches(), data=st.data())
@settings(max_examples=40)
def test_nll_microbatch_losses_sum_to_the_batch_loss(batch, data):
    tensors, lp = batch
    assert_partition_invariant(NLLLoss(), tensors, lp, data.draw(partitions(lp.shape[0])))


@given(batch=pg_batches(), cfg=pg_configs(), data=st.data())
def test_clipped_pg_microbatch_losses_and_metrics_sum_to_the_batch(batch, cfg, data):
    tensors, lp = batch
    parts = data.draw(partitions(lp.shape[0]))
    assert_partition_invariant(ClippedPGLossFn(cfg), tensors, lp, parts)


@given(
    batch=pg_batches(even_rows=True),
    data=st.data(),
    cfg=st.fixed_dictionaries(
        {
            "reference_policy_kl_penalty": st.sampled_from([0.05, 0.5]),
            "sft_loss_weight": st.sampled_from([0.0, 0.3]),
            "preference_average_log_probs": st.booleans(),
            "sft_average_log_probs": st.booleans(),
        }
    ),
)
@settings(max_examples=50)
def test_dpo_microbatch_losses_and_metrics_sum_to_the_batch_when_pairs_stay_together(
    batch, data, cfg
):
    tensors, lp = batch
    parts = data.draw(partitions(lp.shape[0], group=2))
    assert_partition_invariant(DPOLossFn(cfg), tensors, lp, parts)


# ------------------------------------------------------------------------------ hand values


def test_ppo_clip_matches_the_hand_computed_value():
    """Ratios [0.5, 1, 1.5], A = [1, -1, 2], ε = 0.2: mean(-0.5, 1, -2.4) = -0.6333…"""
    lp = torch.log(torch.tensor([[0.5, 1.0, 1.5]], dtype=F64))
    data = {
        "token_mask": torch.ones(1, 4),
        "sample_mask": torch.ones(1),
        "advantages": torch.tensor([[9.0, 1.0, -1.0, 2.0]]),
        "prev_logprobs": torch.zeros(1, 4),
        "generation_logprobs": torch.zeros(1, 4),
    }
    loss, metrics = call(
        ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}),
        data,
        lp,
        torch.tensor(1.0),
        torch.tensor(3.0),
    )
    assert loss.item() == pytest.approx(-0.633333333, abs=1e-6)
    assert metrics["probs_ratio_clamped_min"] == pytest.approx(0.8)
    assert metrics["probs_ratio_max"] == pytest.approx(1.5)


def _logprobs_from_logits(logits_BSV, token_ids_BS):
    logprobs = torch.log_softmax(logits_BSV[:, :-1].to(F64), dim=-1)
    return logprobs.gather(-1, token_ids_BS[:, 1:, None])[..., 0]


@pytest.mark.parametrize(("correct", "expected"), [(True, 0.0), (False, 999.0)])
def test_nll_hand_values_from_logits(correct, expected):
    """Logit 999 on the right next token gives loss ~0; on a wrong token, 999 per token."""
    token_ids = torch.tensor([[0, 1, 2, 3]])
    logits = torch.zeros(1, 4, 8)
    for t in range(3):
        logits[0, t, token_ids[0, t + 1] if correct else 7] = 999.0
    data = {"token_mask": torch.tensor([[0, 0, 1, 1]]), "sample_mask": torch.ones(1)}
    lp = _logprobs_from_logits(logits, token_ids)
    loss, metrics = call(NLLLoss(), data, lp, torch.tensor(1.0), torch.tensor(2.0))
    assert loss.item() == pytest.approx(expected, abs=1e-4)
    assert metrics["num_unmasked_tokens"] == 2
    assert metrics["num_valid_samples"] == 1


def test_dpo_matches_the_closed_form_for_one_pair():
    beta = 0.1
    lp = torch.tensor([[-0.5, -1.0], [-2.0, -0.25]], dtype=F64)
    ref = torch.tensor([[0.0, -1.0, -0.7], [0.0, -1.0, -1.0]], dtype=F64)
    data = {
        "token_mask": torch.ones(2, 3),
        "sample_mask": torch.ones(2),
        "reference_policy_logprobs": ref,
    }
    loss, m = call(
        DPOLossFn({"reference_policy_kl_penalty": beta, "sft_loss_weight": 0.5}),
        data,
        lp,
        torch.tensor(2.0),
        torch.tensor(4.0),
    )
    r_chosen, r_rejected = (-0.5 + 1.0) + (-1.0 + 0.7), (-2.0 + 1.0) + (-0.25 + 1.0)
    preference = -math.log(1 / (1 + math.exp(-beta * (r_chosen - r_rejected))))
    assert m["preference_loss"] == pytest.approx(preference)
    assert m["sft_loss"] == pytest.approx(1.5)
    assert loss.item() == pytest.approx(preference + 0.5 * 1.5)
    assert (m["accuracy"], m["num_valid_samples"]) == (1.0, 1.0)
    assert (m["rewards_chosen_mean"], m["rewards_rejected_mean"]) == pytest.approx(
        (r_chosen, r_rejected)
    )


# ---------------------------------------------------------------- closed forms and identities


@given(batch=pg_batches(), cfg=pg_configs())
@settings(max_examples=50)
def test_unit_ratio_and_zero_advantage_give_zero_actor_loss(batch, cfg):
    data, lp = batch
    data = data | {
        "advantages": torch.zeros_like(data["advantages"]),
        "prev_logprobs": torch.cat([data["prev_logprobs"][:, :1], lp], 1),
    }
    cfg = cfg | {"reference_policy_kl_penalty": 0.0, "positive_example_nll_weight": 0.0}
    loss, metrics = call(ClippedPGLossFn(cfg), data, lp, *global_counts(data))
    assert loss.item() == 0.0
    if not cfg["disable_ppo_ratio"] and metrics["probs_ratio_min"] != math.inf:
        assert metrics["probs_ratio_min"] == pytest.approx(1.0)
        assert metrics["probs_ratio_max"] == pytest.approx(1.0)


@given(batch=pg_batches(), kl_type=st.sampled_from(["k1", "k2", "k3"]))
def test_kl_is_zero_when_current_equals_reference(batch, kl_type):
    data, lp = batch
    data = {k: v for k, v in data.items() if k != "curr_logprobs_unfiltered"} | {
        "advantages": torch.zeros_like(data["advantages"]),
        "reference_policy_logprobs": torch.cat([data["prev_logprobs"][:, :1], lp], 1),
    }
    cfg = {"reference_policy_kl_penalty": 0.3, "reference_policy_kl_type": kl_type}
    loss, metrics = call(ClippedPGLossFn(cfg), data, lp, *global_counts(data))
    assert loss.item() == 0.0
    assert metrics["kl_penalty"] == 0.0


def _kl_closed_form(kl_type, curr, ref):
    logr = ref - curr
    return {"k1": -logr, "k2": logr**2 / 2, "k3": torch.exp(logr) - 1 - logr}[kl_type]


@given(
    seed=SEEDS,
    kl_type=st.sampled_from(["k1", "k2", "k3"]),
    clamps=st.sampled_from([(None, None), (20.0, 10.0), (0.5, 0.3)]),
)
def test_kl_estimators_match_closed_forms_with_clamps(seed, kl_type, clamps):
    g = torch.Generator().manual_seed(seed)
    curr, ref = 2 * _randn(g, 3, 5), 2 * _randn(g, 3, 5)
    input_clamp, output_clamp = clamps
    clamped_ref = ref
    if input_clamp is not None:
        clamped_ref = curr + (ref - curr).clamp(-input_clamp, input_clamp)
    expected = _kl_closed_form(kl_type, curr, clamped_ref)
    if output_clamp is not None:
        expected = expected.clamp(-output_clamp, output_clamp)
    got = kl_estimate(
        curr, ref, kl_type=kl_type, input_clamp=input_clamp, output_clamp=output_clamp
    )
    torch.testing.assert_close(got, expected)
    if kl_type != "k1":
        assert bool((got >= 0).all())


def _kl_only_batch(seed, B=3, S=6):
    g = torch.Generator().manual_seed(seed)
    lp = -_randn(g, B, S - 1).abs()
    data = {
        "token_mask": _bits(g, 0.7, B, S),
        "sample_mask": torch.ones(B, dtype=F64),
        "advantages": torch.zeros(B, S, dtype=F64),
        "prev_logprobs": _randn(g, B, S),
        "generation_logprobs": torch.cat([_randn(g, B, 1), lp + 0.2 * _randn(g, B, S - 1)], 1),
        "reference_policy_logprobs": torch.cat(
            [_randn(g, B, 1), lp + 0.5 * _randn(g, B, S - 1)], 1
        ),
    }
    return data, lp


@given(seed=SEEDS, kl_type=st.sampled_from(["k1", "k2", "k3"]), on_policy=st.booleans())
def test_kl_loss_and_its_score_function_gradient_match_closed_forms(seed, kl_type, on_policy):
    """loss = β·mean(w·k) and ∂/∂curr = β·w·(k + ∂k/∂curr) / N, w = exp(curr − sg(curr) or gen)."""
    beta = 0.2
    data, lp = _kl_only_batch(seed)
    lp = lp.clone().requires_grad_(True)
    cfg = {
        "reference_policy_kl_penalty": beta,
        "reference_policy_kl_type": kl_type,
        "use_on_policy_kl_approximation": on_policy,
    }
    gvs, gvt = global_counts(data)
    loss, _ = call(ClippedPGLossFn(cfg), data, lp, gvs, gvt)
    loss.backward()
    curr, ref = lp.detach(), data["reference_policy_logprobs"][:, 1:]
    mask = data["token_mask"][:, 1:]
    w = torch.exp(curr - data["generation_logprobs"][:, 1:]) if on_policy else torch.ones_like(curr)
    k = _kl_closed_form(kl_type, curr, ref)
    dk = {"k1": torch.ones_like(curr), "k2": -(ref - curr), "k3": 1 - torch.exp(ref - curr)}[
        kl_type
    ]
    torch.testing.assert_close(loss.detach(), beta * (w * k * mask).sum() / (gvt + 1e-8))
    torch.testing.assert_close(lp.grad, beta * w * (k + dk) * mask / (gvt + 1e-8))


@given(seed=SEEDS, eps=st.sampled_from([(0.2, 0.2), (0.1, 0.28)]))
def test_ppo_gradient_is_zero_exactly_where_the_clip_is_active(seed, eps):
    g = torch.Generator().manual_seed(seed)
    B, S = 4, 7
    lp = (-_randn(g, B, S - 1).abs()).requires_grad_(True)
    prev = lp.detach() + 0.4 * _randn(g, B, S - 1)
    data = {
        "token_mask": _bits(g, 0.8, B, S),
        "sample_mask": torch.ones(B, dtype=F64),
        "advantages": _randn(g, B, S),
        "generation_logprobs": torch.zeros(B, S, dtype=F64),
        "prev_logprobs": torch.cat([torch.zeros(B, 1, dtype=F64), prev], 1),
    }
    cfg = {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": eps[0], "ratio_clip_max": eps[1]}
    gvs, gvt = global_counts(data)
    loss, _ = call(ClippedPGLossFn(cfg), data, lp, gvs, gvt)
    loss.backward()
    ratio, adv = torch.exp(lp.detach() - prev), data["advantages"][:, 1:]
    mask = data["token_mask"][:, 1:]
    clipped = ((adv > 0) & (ratio > 1 + eps[1])) | ((adv < 0) & (ratio < 1 - eps[0]))
    expected = torch.where(clipped, 0.0, -adv * ratio) * mask / (gvt + 1e-8)
    torch.testing.assert_close(lp.grad, expected)
    assert bool((lp.grad[clipped] == 0).all())


def test_dual_clip_bounds_the_loss_of_negative_advantages_by_c():
    """A = -1 and ratio 5 > c = 3: the term is -A·c = 3 with zero gradient (plain PPO gives 5)."""
    lp = torch.tensor([[math.log(5.0)]], dtype=F64, requires_grad=True)
    data = {
        "token_mask": torch.ones(1, 2),
        "sample_mask": torch.ones(1),
        "advantages": torch.tensor([[0.0, -1.0]]),
        "prev_logprobs": torch.zeros(1, 2),
        "generation_logprobs": torch.zeros(1, 2),
    }
    one = torch.tensor(1.0)
    plain, _ = call(
        ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}), data, lp.detach(), one, one
    )
    dual, _ = call(
        ClippedPGLossFn({"reference_policy_kl_penalty": 0.0, "ratio_clip_c": 3.0}),
        data,
        lp,
        one,
        one,
    )
    dual.backward()
    assert plain.item() == pytest.approx(5.0)
    assert dual.item() == pytest.approx(3.0)
    assert lp.grad.item() == 0.0


@given(seed=SEEDS)
def test_gspo_uses_one_ratio_per_sequence_equal_to_the_geometric_mean(seed):
    g = torch.Generator().manual_seed(seed)
    lp = -_randn(g, 1, 5).abs()
    prev = lp + 0.2 * _randn(g, 1, 5)
    data = {
        "token_mask": torch.tensor([[0, 1, 1, 0, 1, 1]], dtype=F64),
        "sample_mask": torch.ones(1),
        "advantages": torch.ones(1, 6),
        "generation_logprobs": torch.zeros(1, 6),
        "prev_logprobs": torch.cat([torch.zeros(1, 1, dtype=F64), prev], 1),
    }
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "token_level_loss": False,
        "sequence_level_importance_ratios": True,
        "ratio_clip_min": 10.0,
        "ratio_clip_max": 10.0,
    }
    loss, m = call(ClippedPGLossFn(cfg), data, lp, torch.tensor(1.0), torch.tensor(4.0))
    keep = data["token_mask"][0, 1:].bool()
    expected = torch.exp((lp - prev)[0, keep].mean()).item()
    assert m["probs_ratio_min"] == pytest.approx(expected)
    assert m["probs_ratio_max"] == pytest.approx(expected)
    assert loss.item() == pytest.approx(-expected)


# ------------------------------------------------------------- importance-sampling truncation


def _truncation_reference(w, kind, hi, lo, geo_mean):
    if kind == "tis":
        return min(max(w, 0.0 if lo is None else lo), hi)
    if kind == "icepop":
        return w if lo <= w <= hi else 0.0
    return w if lo <= geo_mean <= hi else 0.0


@given(
    seed=SEEDS,
    kind=st.sampled_from(["tis", "icepop", "seq-mask-tis"]),
    bounds=st.sampled_from([(0.8, 1.25), (0.5, 2.0), (None, 1.5)]),
)
def test_truncated_importance_weights_match_a_per_element_reference(seed, kind, bounds):
    lo, hi = bounds
    if kind != "tis" and lo is None:
        lo = 0.9
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 4
    log_w = 0.5 * _randn(g, B, T)
    mask = _bits(g, 0.8, B, T)
    seq_mean = (log_w * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    got, metrics = truncate_importance_weights(
        torch.exp(log_w),
        kind=kind,
        ratio_max=hi,
        ratio_min=lo,
        seq_log_ratio_mean_B=seq_mean,
        mask_BT=mask,
        sample_mask_B=torch.ones(B, dtype=F64),
        global_valid_toks=mask.sum(),
        global_valid_seqs=float(B),
    )
    expected = torch.tensor(
        [
            [
                _truncation_reference(math.exp(log_w[b, t]), kind, hi, lo, math.exp(seq_mean[b]))
                for t in range(T)
            ]
            for b in range(B)
        ],
        dtype=F64,
    )
    torch.testing.assert_close(got, expected)
    assert 0.0 <= metrics["is_oob_ratio"] <= 1.0


# ---------------------------------------------------------------- masks, NaN and gradients


def _all_losses(cfg):
    return [NLLLoss(), ClippedPGLossFn(cfg), DPOLossFn({"sft_loss_weight": 0.5})]


@given(batch=pg_batches(even_rows=True), cfg=pg_configs())
@settings(max_examples=40)
def test_zero_mask_gives_zero_loss_finite_metrics_and_zero_gradient(batch, cfg):
    data, lp = batch
    data = data | {
        "token_mask": torch.zeros_like(data["token_mask"]),
        "sample_mask": torch.zeros_like(data["sample_mask"]),
    }
    lp = lp.clone().masked_fill(torch.ones_like(lp, dtype=torch.bool), -math.inf)
    lp.requires_grad_(True)
    for loss_fn in _all_losses(cfg):
        loss, metrics = call(loss_fn, data, lp, torch.tensor(0.0), torch.tensor(0.0))
        loss.backward()
        assert loss.item() == 0.0
        assert not any(math.isnan(v) for v in metrics.values())
        assert bool((lp.grad == 0).all())
        lp.grad = None


@given(batch=pg_batches(even_rows=True), cfg=pg_configs())
@settings(max_examples=40)
def test_gradients_are_finite_and_zero_on_masked_tokens(batch, cfg):
    data, lp = batch
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    lp = torch.where(mask.bool(), lp, torch.full_like(lp, -math.inf)).requires_grad_(True)
    for loss_fn in _all_losses(cfg):
        loss, _ = call(loss_fn, data, lp, *global_counts(data))
        loss.backward()
        assert torch.isfinite(loss)
        assert bool(torch.isfinite(lp.grad).all())
        assert bool((lp.grad[mask == 0] == 0).all())
        lp.grad = None


@given(seed=SEEDS, n=st.integers(1, 20))
def test_masked_mean_is_the_masked_sum_over_factor_plus_eps(seed, n):
    g = torch.Generator().manual_seed(seed)
    values, mask = _randn(g, n), _bits(g, 0.6, n)
    values = torch.where(mask.bool(), values, torch.full_like(values, math.nan))
    masked_sum = sum(float(v) for v, m in zip(values, mask, strict=True) if m)
    count = float(mask.sum())
    assert masked_mean(values, mask).item() == pytest.approx(masked_sum / (count + 1e-8))
    assert masked_mean(values, mask, global_normalization_factor=7.0).item() == pytest.approx(
        masked_sum / (7.0 + 1e-8)
    )


# ------------------------------------------------------------------------ protocol and errors


def test_losses_satisfy_the_loss_function_protocol():
    assert NLLLoss().loss_type == LossType.TOKEN_LEVEL
    assert ClippedPGLossFn({"token_level_loss": False}).loss_type == LossType.SEQUENCE_LEVEL
    assert DPOLossFn({}).loss_type == LossType.SEQUENCE_LEVEL
    for loss_fn in (NLLLoss(), ClippedPGLossFn({}), DPOLossFn({})):
        assert isinstance(loss_fn, LossFunction)
        assert loss_fn.input_type == LossInputType.LOGPROB
    assert LossType.TOKEN_LEVEL == "token_level"
    assert LossInputType.LOGIT == "logit"


def test_missing_keys_take_nemo_rl_defaults_and_kl_in_reward_zeroes_beta():
    fn = ClippedPGLossFn({})
    assert (fn.cfg.ratio_clip_min, fn.cfg.ratio_clip_max, fn.cfg.ratio_clip_c) == (0.2, 0.2, None)
    assert (fn.cfg.reference_policy_kl_type, fn.reference_policy_kl_penalty) == ("k3", 0.01)
    assert (fn.cfg.kl_input_clamp_value, fn.cfg.kl_output_clamp_value) == (20.0, 10.0)
    assert ClippedPGLossFn({"use_kl_in_reward": True}).reference_policy_kl_penalty == 0.0
    assert DPOLossFn({"max_num_epochs": 1, "seed": 42}).reference_policy_kl_penalty == 0.05
    legacy = ClippedPGLossFn(
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0}
    )
    assert legacy.cfg.truncated_importance_sampling_type == "tis"


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            {"ratio_clip_mni": 0.2},
            r"unknown key 'ratio_clip_mni' \(did you mean 'ratio_clip_min'\? accepted keys: ",
        ),
        (
            {"ratio_clip_min": "0.2"},
            r"ratio_clip_min must be a number, got '0.2' @ loss_fn.ratio_clip_min",
        ),
        ({"token_level_loss": 1}, r"token_level_loss must be a bool"),
        ({"reference_policy_kl_type": "k4"}, r"'k1', 'k2' or 'k3', got 'k4'"),
        ({"ratio_clip_c": 1.0}, r"ratio_clip_c \(dual clip\) must be > 1"),
        ({"sequence_level_importance_ratios": True}, r"set token_level_loss: false"),
        (
            {
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2.0,
            },
            r"needs use_importance_sampling_correction: true",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 2.0,
            },
            r"needs truncated_importance_sampling_ratio_min",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
            },
            r"truncated_importance_sampling_ratio must be a positive number",
        ),
        (
            {"use_cispo": True, "ratio_clip_c": 3.0},
            r"use_cispo cannot be combined with ratio_clip_c",
        ),
    ],
)
def test_bad_clipped_pg_configs_raise_config_errors_naming_the_key(cfg, match):
    with pytest.raises(ConfigError, match=match):
        ClippedPGLossFn(cfg)


def test_every_config_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        ClippedPGLossFn({"typo_a": 1, "typo_b": 2, "ratio_clip_max": None})
    assert str(info.value).count("\n") == 2
    with pytest.raises(ValueError, match=r"unknown key 'beta'.*@ dpo.beta"):
        DPOLossFn({"beta": 0.1})


def test_bad_data_raises_value_errors_naming_key_and_shape():
    lp = torch.zeros(2, 3)
    data = {"token_mask": torch.ones(2, 4), "sample_mask": torch.ones(2)}
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"data\['prev_logprobs'\], which is missing"):
        call(ClippedPGLossFn({}), data, lp, one, one)
    with pytest.raises(
        ValueError, match=r"data\['token_mask'\] has shape \(2, 3\).*must be \(2, 4\)"
    ):
        call(NLLLoss(), data | {"token_mask": torch.ones(2, 3)}, lp, one, one)
    with pytest.raises(ValueError, match=r"exactly the keyword input next_token_logprobs"):
        NLLLoss()(data=data, global_valid_seqs=one, global_valid_toks=one, logits=lp)
    with pytest.raises(ValueError, match=r"even number of rows"):
        call(
            DPOLossFn({}),
            data | {"sample_mask": torch.ones(3), "token_mask": torch.ones(3, 4)},
            torch.zeros(3, 3),
            one,
            one,
        )


@given(seed=SEEDS)
def test_kl_uses_unfiltered_logprobs_when_present(seed):
    """KL is taken on curr_logprobs_unfiltered (here equal to ref, so KL = 0 and no gradient)."""
    data, lp = _kl_only_batch(seed)
    unfiltered = data["reference_policy_logprobs"][:, 1:].clone().requires_grad_(True)
    lp = lp.clone().requires_grad_(True)
    cfg = {"reference_policy_kl_penalty": 0.5, "reference_policy_kl_type": "k2"}
    loss, metrics = call(
        ClippedPGLossFn(cfg),
        data | {"curr_logprobs_unfiltered": unfiltered},
        lp,
        *global_counts(data),
    )
    loss.backward()
    assert loss.item() == 0.0 and metrics["kl_penalty"] == 0.0
    assert bool((lp.grad == 0).all()) and unfiltered.grad is not None

"""Properties of policyworker.functional.moe: the gate-bias rule and the router-replay helpers."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.moe import (
    MISSING_ROUTE,
    RouterRule,
    balancing_bias_update,
    effective_routes,
    gate_weights_at,
    payload_layers,
    route_problem,
)
from tests.property.strategies import SEEDS, seeded_randn

loads = st.lists(st.integers(0, 10_000), min_size=1, max_size=16).map(torch.tensor)
rates = st.sampled_from([0.0, 1e-3, 0.01, 0.5])
RULES = [
    RouterRule(scoring="sigmoid", normalize=True, norm_epsilon=1e-20, scale=True, scaling=2.5),
    RouterRule(scoring="softmax", normalize=True, cast_to_logits_dtype=True),
    RouterRule(scoring="softmax", normalize=False),
    RouterRule(scoring="softmax", normalize=True, upcast_before_softmax=True),
]


# ---------------------------------------------------------------------------- bias update


@given(loads, rates)
def test_direction_each_expert_moves_toward_the_mean_load(load, rate):
    delta = balancing_bias_update(load, rate)
    mean = load.double().mean()
    step = float(torch.tensor(rate, dtype=torch.float32))  # the rate as the fp32 bias holds it
    assert delta.dtype == torch.float32 and delta.shape == load.shape
    for value, change in zip(load.tolist(), delta.tolist(), strict=True):
        if value > mean:
            assert change == -step
        elif value < mean:
            assert change == step
        else:
            assert change == 0.0


@given(st.integers(1, 16), st.integers(0, 1000), rates)
def test_perfect_balance_changes_nothing(num_experts, per_expert, rate):
    delta = balancing_bias_update(torch.full((num_experts,), per_expert), rate)
    assert torch.equal(delta, torch.zeros(num_experts))


@given(st.integers(0, 1000), st.lists(st.integers(0, 1000), min_size=1, max_size=8), rates)
def test_conservation_loads_symmetric_about_the_mean_leave_the_mean_bias_unchanged(
    mean, offsets, rate
):
    # loads mean +- d: as many experts above the mean as below it, so the steps cancel
    load = torch.tensor([mean + 1000 + d for d in offsets] + [mean + 1000 - d for d in offsets])
    delta = balancing_bias_update(load, rate)
    assert float(delta.double().sum()) == 0.0  # exact: few fp32 values summed in fp64


@given(loads, rates, SEEDS)
def test_permuting_experts_permutes_the_update(load, rate, seed):
    perm = torch.randperm(load.numel(), generator=torch.Generator().manual_seed(seed))
    permuted = balancing_bias_update(load[perm], rate)
    assert torch.equal(permuted, balancing_bias_update(load, rate)[perm])


@given(st.lists(loads, min_size=1, max_size=4), rates)
def test_leading_dims_are_independent_routers(rows, rate):
    width = min(r.numel() for r in rows)
    stacked = torch.stack([r[:width] for r in rows])
    want = torch.stack([balancing_bias_update(r[:width], rate) for r in rows])
    assert torch.equal(balancing_bias_update(stacked, rate), want)


def test_bias_update_rejects_negative_rates_and_float_loads():
    with pytest.raises(ValueError, match="rate"):
        balancing_bias_update(torch.tensor([1, 2]), -0.1)
    with pytest.raises(ValueError, match="integer"):
        balancing_bias_update(torch.tensor([1.0, 2.0]), 0.1)


# ---------------------------------------------------------------------------- replay


@st.composite
def routed_logits(draw):
    """(logits [N, E], own top-k experts [N, K], K)."""
    n, e = draw(st.integers(1, 12)), draw(st.integers(2, 8))
    k = draw(st.integers(1, e))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    logits = (3.0 * seeded_randn(draw(SEEDS), (n, e))).to(dtype)
    own = torch.topk(logits.float(), k, dim=-1).indices
    return logits, own, k


@given(routed_logits(), st.sampled_from(RULES), SEEDS)
def test_gate_weights_follow_their_experts_under_a_permutation(case, rule, seed):
    logits, own, k = case
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    weights = gate_weights_at(logits, own, rule)
    torch.testing.assert_close(gate_weights_at(logits, own[:, perm], rule), weights[:, perm])


@given(routed_logits())
def test_softmax_weights_unnormalized_are_the_probabilities_and_normalized_sum_to_one(case):
    logits, own, _ = case
    probs = torch.softmax(logits.float(), dim=-1)
    raw = gate_weights_at(logits, own, RULES[2])
    assert torch.equal(raw, probs.gather(1, own))
    total = gate_weights_at(logits, own, RULES[3]).sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total))


@given(routed_logits(), SEEDS)
def test_gate_weights_gradient_matches_the_deepseek_formula_written_out(case, seed):
    logits, own, _ = case
    coeff = seeded_randn(seed, tuple(own.shape))
    first = logits.float().requires_grad_()
    (gate_weights_at(first, own, RULES[0]) * coeff).sum().backward()
    second = logits.float().requires_grad_()
    chosen = torch.sigmoid(second).gather(1, own)
    ((chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * 2.5) * coeff).sum().backward()
    torch.testing.assert_close(first.grad, second.grad)


@given(routed_logits(), SEEDS)
def test_effective_routes_take_recorded_rows_and_keep_own_rows_where_missing(case, seed):
    _, own, k = case
    gen = torch.Generator().manual_seed(seed)
    recorded = torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(own.shape[0])])
    missing = torch.rand(own.shape[0], generator=gen) < 0.5
    recorded[missing] = MISSING_ROUTE
    out = effective_routes(own, recorded)
    assert out.dtype == own.dtype
    assert torch.equal(out[missing], own[missing])
    assert torch.equal(out[~missing], recorded[~missing])


def test_effective_routes_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="top_k"):
        effective_routes(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64))


@given(st.integers(1, 6), st.integers(1, 4), SEEDS)
def test_valid_routes_have_no_problem(tokens, k, seed):
    gen = torch.Generator().manual_seed(seed)
    routes = torch.stack([torch.randperm(k + 3, generator=gen)[:k] for _ in range(tokens)])
    routes[0] = MISSING_ROUTE
    assert route_problem(routes, num_experts=k + 3) is None


@pytest.mark.parametrize(
    ("routes", "needle"),
    [
        ([[0, 4]], "outside [0, 4)"),
        ([[0, -1]], "a whole row of -1"),
        ([[-2, -2]], "a whole row of -1"),
        ([[1, 1]], "repeats an expert"),
        ([[0.0, 1.0]], "not an integer dtype"),
    ],
)
def test_route_problems_are_named(routes, needle):
    problem = route_problem(torch.tensor(routes), num_experts=4)
    assert problem is not None and needle in problem


@given(st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True), st.integers(1, 60))
def test_payload_layers_compressed_or_full_or_none(layer_set, extra):
    moe = sorted(layer_set)
    num_layers = moe[-1] + 1 + extra
    assert payload_layers(moe, num_payload_layers=len(moe), num_layers=num_layers) == list(
        range(len(moe))
    )
    if num_layers != len(moe):
        assert payload_layers(moe, num_payload_layers=num_layers, num_layers=num_layers) == moe
        other = num_layers + 1
        assert payload_layers(moe, num_payload_layers=other, num_layers=num_layers) is None

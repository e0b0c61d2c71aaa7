"""Properties of policyworker.functional.batching: microbatch plans and reordering."""

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import policyworker.functional.batching as batching
from policyworker.functional.batching import (
    MicrobatchPlan,
    dummy_microbatches,
    dynamic_microbatches,
    fixed_microbatches,
    inverse_permutation,
    num_dummy_microbatches,
    packed_microbatches,
    rows_in_input_order,
    token_budget_boundaries,
)
from tests.property.strategies import SEEDS, seeded_randn

LENGTHS = st.lists(st.integers(0, 64), min_size=1, max_size=24)
ALGORITHMS = st.sampled_from(
    ["first_fit_decreasing", "modified_first_fit_decreasing", "first_fit_shuffle", "concatenative"]
)


def covered_once(plans, n):
    return sorted(r for p in plans if not p.is_dummy for r in p.rows) == list(range(n))


@given(st.integers(0, 40), st.integers(1, 9), st.integers(1, 16))
def test_fixed_plans_cover_rows_in_order_at_full_width(batch_size, mbs, seq_len):
    plans = fixed_microbatches(batch_size, mbs, seq_len=seq_len)
    assert [r for p in plans for r in p.rows] == list(range(batch_size))
    assert all(len(p.rows) == mbs for p in plans[:-1]) and all(p.width == seq_len for p in plans)
    assert len(plans) == -(-batch_size // mbs)


@given(LENGTHS, st.sampled_from([1, 4, 8]), st.integers(0, 3))
def test_dynamic_plans_cover_rows_once_and_respect_the_budget(lengths, rounding, slack):
    seq_len = max(lengths) + slack
    max_tokens = max(seq_len, 1) * 3
    plans = dynamic_microbatches(
        lengths, max_tokens=max_tokens, sequence_length_round=rounding, seq_len=seq_len
    )
    assert covered_once(plans, len(lengths))
    for plan in plans:
        assert len(plan.rows) * plan.width <= max_tokens
        assert max(lengths[r] for r in plan.rows) <= plan.width <= max(seq_len, 1)
        assert plan.width % rounding == 0 or plan.width == seq_len


@given(LENGTHS, st.integers(1, 200))
def test_token_budget_groups_are_maximal(lengths, budget):
    """Oracle of the greedy rule: the next position would have broken the budget."""
    widths = [min(n, budget) for n in lengths]
    groups = token_budget_boundaries(widths, max_tokens=budget)
    assert [g[0] for g in groups[1:]] == [g[1] for g in groups[:-1]]
    assert groups[0][0] == 0 and groups[-1][1] == len(widths)
    for (start, end, width), nxt in zip(groups, groups[1:], strict=False):
        assert width == max(widths[start:end]) and (end - start) * width <= budget
        assert (end - start + 1) * max(width, widths[nxt[0]]) > budget


@given(LENGTHS, ALGORITHMS, st.sampled_from([1, 4, 16]))
def test_packed_plans_cover_rows_once_and_fit_the_capacity(lengths, algorithm, pad_multiple):
    capacity = 64 * 2
    plans = packed_microbatches(
        lengths, capacity=capacity, algorithm=algorithm, pad_multiple=pad_multiple
    )
    assert covered_once(plans, len(lengths)) and all(p.packed for p in plans)
    for plan in plans:
        padded = sum(-(-lengths[r] // pad_multiple) * pad_multiple for r in plan.rows)
        assert plan.width == padded <= capacity


@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.integers(0, 7))
def test_dummy_microbatches_cycle_the_real_plans(sizes, extra):
    plans = fixed_microbatches(sum(sizes), 2, seq_len=4)
    local, peak = len(plans), len(plans) + extra
    dummies = dummy_microbatches(plans, num_dummy_microbatches(local, peak))
    assert len(plans) + len(dummies) == peak
    assert all(d.is_dummy for d in dummies)
    undummied = [attrs.evolve(d, is_dummy=False) for d in dummies]
    assert undummied == [plans[i % local] for i in range(extra)]
    assert rows_in_input_order(plans + dummies) == rows_in_input_order(plans)


@given(st.permutations(list(range(12))), SEEDS)
def test_reordering_outputs_by_rows_in_input_order_restores_input(perm, seed):
    x = seeded_randn(seed, (12, 3))
    plans = [MicrobatchPlan(rows=tuple(perm[i : i + 5]), width=3) for i in range(0, 12, 5)]
    outputs = torch.cat([x[list(p.rows)] for p in plans])
    assert torch.equal(outputs[rows_in_input_order(plans)], x)


@given(st.permutations(list(range(10))))
def test_inverse_permutation_composes_to_identity(perm):
    inverse = inverse_permutation(perm)
    assert [perm[i] for i in inverse] == list(range(10))
    assert inverse_permutation(torch.tensor(inverse)) == list(perm)


def test_dynamic_reference_example_widths_are_rounded_and_within_budget():
    lengths = [2, 8, 4, 16, 28, 32, 2, 32]
    plans = dynamic_microbatches(lengths, max_tokens=32, sequence_length_round=4, seq_len=128)
    assert covered_once(plans, 8)
    assert all(p.width % 4 == 0 and p.width * len(p.rows) <= 32 for p in plans)
    assert [p.rows for p in plans][:2] == [(0, 6, 2, 1), (3,)]


def test_bad_arguments_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="row 1 has length 40.*> max_tokens 32.*raise"):
        dynamic_microbatches([3, 40], max_tokens=32, sequence_length_round=4, seq_len=64)
    with pytest.raises(ValueError, match="local_count=3, max_count=2"):
        num_dummy_microbatches(3, 2)
    with pytest.raises(ValueError, match="permutation of 0..2; missing \\[2\\]"):
        inverse_permutation([0, 1, 1])
    with pytest.raises(ValueError, match="from no plans"):
        dummy_microbatches([], 1)


@given(st.sampled_from(["dynamic", "packed"]), st.integers(-3, 0))
def test_a_token_budget_spec_without_a_budget_is_refused(kind, budget):
    with pytest.raises(ValueError, match="token_budget >= 1"):
        batching.MicrobatchSpec(kind=kind, token_budget=budget)


@given(st.lists(st.integers(0, 16), max_size=12), st.integers(1, 5))
def test_a_fixed_spec_plans_consecutive_rows_of_mbs(lengths, mbs):
    plans = batching.plan_microbatches(
        batching.MicrobatchSpec(), torch.tensor(lengths, dtype=torch.long), seq_len=16, mbs=mbs
    )
    assert plans == batching.fixed_microbatches(len(lengths), mbs, seq_len=16)

"""Properties of policyworker.functional.batch_checks."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.errors import DataError
from policyworker.functional.batch_checks import (
    batch_size_argument,
    cast_loss_inputs,
    counted_positions,
    first_nonfinite,
    first_out_of_range,
    nonfinite_loss_input,
)
from tests.property.strategies import SEEDS, right_padded_batches, seeded_randint, seeded_randn


def _first_by_loop(flags: torch.Tensor) -> tuple[int, ...] | None:
    for flat, flag in enumerate(flags.reshape(-1).tolist()):
        if flag:
            return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), flags.shape))
    return None


@given(SEEDS, st.integers(1, 5), st.integers(1, 7), st.integers(-3, 3), st.integers(1, 20))
def test_first_out_of_range_is_the_first_offender_in_row_major_order(seed, b, s, low, width):
    values = seeded_randint(seed, 30, (b, s)) - 5
    found = first_out_of_range(values, low, low + width)
    expected = _first_by_loop((values < low) | (values >= low + width))
    if expected is None:
        assert found is None
    else:
        assert found == (expected, int(values[expected]))


@given(SEEDS, st.integers(1, 5), st.integers(1, 7), st.floats(0, 1), st.floats(0, 1))
def test_first_nonfinite_matches_a_loop_and_respects_where(seed, b, s, p_bad, p_where):
    gen = torch.Generator().manual_seed(seed)
    values = seeded_randn(seed, (b, s))
    bad = torch.rand(b, s, generator=gen) < p_bad
    values = torch.where(bad, torch.tensor(math.nan), values)
    where = torch.rand(b, s, generator=gen) < p_where
    assert first_nonfinite(values, where) == _first_by_loop(bad & where)
    assert first_nonfinite(values, torch.zeros_like(where)) is None


@given(right_padded_batches(vocab=50, min_len=0), SEEDS)
def test_counted_positions_exclude_column_zero_padding_and_masked(batch, seed):
    tokens_BS, lengths_B = batch
    gen = torch.Generator().manual_seed(seed)
    token_mask = (torch.rand(tokens_BS.shape, generator=gen) > 0.3).float()
    sample_mask = (torch.rand(tokens_BS.shape[:1], generator=gen) > 0.3).float()
    data = {
        "input_ids": tokens_BS.clamp(min=0),
        "input_lengths": lengths_B,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
    }
    counted = counted_positions(data)
    columns = torch.arange(tokens_BS.shape[1])[None]
    expected = (
        (columns >= 1)
        & (columns < lengths_B[:, None])
        & (token_mask != 0)
        & (sample_mask != 0)[:, None]
    )
    assert torch.equal(counted, expected)


@given(SEEDS, st.sampled_from([torch.int64, torch.int32, torch.bool]))
def test_cast_loss_inputs_is_exact_and_leaves_floats_and_the_caller_alone(seed, dtype):
    ints = seeded_randint(seed, 5, (3, 4)) - 2
    advantages = ints.to(dtype)
    floats = seeded_randn(seed, (3, 4))
    data = {"advantages": advantages, "prev_logprobs": floats, "other": ints}
    out = cast_loss_inputs(data)
    assert out["advantages"].dtype == torch.float32
    assert torch.equal(out["advantages"], advantages.to(torch.float64).to(torch.float32))
    assert out["prev_logprobs"] is floats and out["other"] is ints  # not loss inputs: untouched
    assert data["advantages"] is advantages  # the caller's mapping is not modified


def test_cast_loss_inputs_refuses_complex():
    with pytest.raises(DataError, match="'advantages' has complex dtype"):
        cast_loss_inputs({"advantages": torch.zeros(2, dtype=torch.complex64)})


@given(st.one_of(st.integers(-5, 0), st.floats(allow_nan=True), st.text(max_size=3), st.booleans()))
def test_batch_size_argument_refuses_everything_but_positive_ints(value):
    with pytest.raises(DataError, match="must be a positive int"):
        batch_size_argument("gbs", value, 4)


@given(st.integers(1, 10**6))
def test_batch_size_argument_passes_positive_ints_and_defaults_none(value):
    assert batch_size_argument("mbs", value, 4) == value
    assert batch_size_argument("mbs", None, 4) == 4


@given(SEEDS, st.integers(1, 4), st.integers(2, 6))
def test_finite_inputs_pass_and_one_counted_nan_is_named(seed, b, s):
    gen = torch.Generator().manual_seed(seed)
    data = {
        "input_ids": torch.zeros(b, s, dtype=torch.int64),
        "input_lengths": torch.full((b,), s),
        "token_mask": torch.ones(b, s),
        "sample_mask": torch.ones(b),
        "prev_logprobs": seeded_randn(seed, (b, s)),
    }
    assert nonfinite_loss_input(data) is None
    row = int(torch.randint(0, b, (1,), generator=gen))
    col = int(torch.randint(1, s, (1,), generator=gen))
    data["prev_logprobs"][row, col] = math.inf
    reason = nonfinite_loss_input(data)
    assert reason is not None and reason.startswith(f"'prev_logprobs'[{row}, {col}] = inf")
    data["token_mask"][row, col] = 0.0  # masked out: no longer read, no longer refused
    assert nonfinite_loss_input(data) is None

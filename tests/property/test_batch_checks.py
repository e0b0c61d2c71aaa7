"""Properties of policyworker.functional.batch_checks (shapes, loss_inputs, train)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.errors import DataError
from policyworker.functional.batch_checks import (
    TrainBatch,
    batch_size_argument,
    cast_loss_inputs,
    check_batch,
    check_train_batch,
    counted_positions,
    first_nonfinite,
    first_out_of_range,
    nonfinite_loss_input,
    require_token_ids_in_vocab,
    token_ids_as_int64,
)
from policyworker.functional.loss import NLLLoss
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


# ------------------------------------------------------------------ token ids of any integer dtype

INTEGER_DTYPES = [
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
]


def _in_dtype_range(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> list[list[int]]:
    """Python ints spread over the whole range of `dtype` (the oracle's values)."""
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**62)), min(info.max, 2**62)
    gen = torch.Generator().manual_seed(seed)
    unit = torch.rand(shape, generator=gen, dtype=torch.float64).tolist()
    return [[low + int(u * (high - low)) for u in row] for row in unit]


@given(SEEDS, st.sampled_from(INTEGER_DTYPES), st.integers(1, 4), st.integers(1, 6))
def test_token_ids_of_every_integer_dtype_cast_to_int64_exactly(seed, dtype, b, s):
    values = _in_dtype_range(seed, dtype, (b, s))
    ids = torch.tensor(values, dtype=dtype)
    out = token_ids_as_int64("input_ids", ids)
    assert out.dtype == torch.int64 and out.tolist() == values


@given(
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool])
    | st.sampled_from([torch.complex64])
)
def test_non_integer_token_ids_are_refused_naming_the_dtype(dtype):
    with pytest.raises(DataError, match=rf"got dtype {dtype} .*cast with \.long\(\)"):
        token_ids_as_int64("input_ids", torch.zeros(2, 3, dtype=dtype))


@given(SEEDS, st.sampled_from(INTEGER_DTYPES), st.integers(1, 300), st.integers(1, 4))
def test_vocab_check_agrees_with_python_ints_in_every_dtype(seed, dtype, vocab, b):
    values = _in_dtype_range(seed, dtype, (b, 5))
    values[0][0] = min(vocab - 1, torch.iinfo(dtype).max)  # one id inside at least
    ids = torch.tensor(values, dtype=dtype)
    outside = [
        (r, c, v) for r, row in enumerate(values) for c, v in enumerate(row) if not 0 <= v < vocab
    ]
    if not outside:
        assert require_token_ids_in_vocab(ids, vocab).tolist() == values
        return
    r, c, v = outside[0]
    with pytest.raises(DataError, match=rf"'input_ids'\[{r}, {c}\] = {v} is outside"):
        require_token_ids_in_vocab(ids, vocab)


@given(st.integers(0, 2**64 - 1), st.integers(1, 2**20))
def test_uint64_ids_are_named_with_their_unsigned_value(value, vocab):
    ids = torch.tensor([[0, value]], dtype=torch.uint64)
    if value < vocab:
        assert require_token_ids_in_vocab(ids, vocab).tolist() == [[0, value]]
    else:
        with pytest.raises(DataError, match=rf"'input_ids'\[0, 1\] = {value} is outside"):
            require_token_ids_in_vocab(ids, vocab)


@given(st.integers(1, 5), st.sampled_from(INTEGER_DTYPES))
def test_a_batch_without_token_columns_is_refused(b, dtype):
    data = {
        "input_ids": torch.zeros(b, 0, dtype=dtype),
        "input_lengths": torch.zeros(b, dtype=dtype),
    }
    with pytest.raises(DataError, match=rf"'input_ids' has shape \({b}, 0\): no token positions"):
        check_batch(data, vocab_size=10)


@given(SEEDS, st.sampled_from(INTEGER_DTYPES), st.integers(1, 5), st.integers(1, 9))
def test_lengths_of_every_integer_dtype_are_range_checked_and_cast(seed, dtype, b, s):
    lengths = seeded_randint(seed, s + 1, (b,))
    data = {"input_ids": torch.zeros(b, s, dtype=torch.int8), "input_lengths": lengths.to(dtype)}
    out = check_batch(data, vocab_size=1)
    assert out["input_lengths"].dtype == torch.int64 and torch.equal(out["input_lengths"], lengths)
    assert out["input_ids"].dtype == torch.int64 and data["input_ids"].dtype == torch.int8
    big = torch.iinfo(dtype).max
    if big > s:
        data["input_lengths"] = torch.full((b,), big, dtype=dtype)
        with pytest.raises(
            DataError, match=rf"'input_lengths'\[0\] = {big} is outside \[0, S={s}\]"
        ):
            check_batch(data, vocab_size=1)


# ------------------------------------------------------------------ per-sequence advantages


@given(SEEDS, st.integers(1, 5), st.integers(1, 9), st.sampled_from([torch.float32, torch.int64]))
def test_per_sequence_advantages_broadcast_over_the_row(seed, b, s, dtype):
    per_row = (seeded_randn(seed, (b,)) * 4).to(dtype)
    data = {"input_ids": torch.zeros(b, s, dtype=torch.int64), "advantages": per_row}
    out = cast_loss_inputs(data)["advantages"]
    assert out.shape == (b, s) and out.dtype == torch.float32
    assert torch.equal(out, per_row.float()[:, None].expand(b, s))
    assert data["advantages"] is per_row


@given(
    st.sampled_from(
        ["prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "token_mask"]
    ),
    st.integers(1, 5),
)
def test_other_per_token_inputs_given_per_sequence_are_refused(key, b):
    data = {"input_ids": torch.zeros(b, 4, dtype=torch.int64), key: torch.zeros(b)}
    with pytest.raises(
        DataError, match=rf"'{key}' has shape \({b},\), but it holds one value per token"
    ):
        cast_loss_inputs(data)


# ------------------------------------------------------------------ check_train_batch


def _train_data(seed: int, rows: int, s: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, s + 1, (rows,), generator=gen)
    return {
        "input_ids": torch.randint(0, 50, (rows, s), generator=gen).to(torch.int16),
        "input_lengths": lengths.to(torch.int32),
        "token_mask": (torch.rand(rows, s, generator=gen) > 0.3).to(torch.bool),
        "sample_mask": torch.ones(rows, dtype=torch.int64),
        "prev_logprobs": -torch.rand(rows, s, generator=gen),
    }


@given(SEEDS, st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(2, 7))
def test_check_train_batch_casts_once_and_records_untrusted_global_batches(
    seed, dp, gbs_per_dp, num_gb, s
):
    gbs = dp * gbs_per_dp
    rows = gbs_per_dp * num_gb
    data = _train_data(seed, rows, s)
    bad_row = seed % rows
    data["prev_logprobs"][bad_row, s - 1] = math.nan
    batch = check_train_batch(
        data, NLLLoss(), vocab_size=50, dp_size=dp, gbs=gbs, mbs=None, default_gbs=9, default_mbs=2
    )
    assert isinstance(batch, TrainBatch) and (batch.gbs, batch.mbs) == (gbs, 2)
    assert batch.data["input_ids"].dtype == batch.data["input_lengths"].dtype == torch.int64
    assert batch.data["token_mask"].dtype == batch.data["sample_mask"].dtype == torch.float32
    assert torch.equal(batch.data["input_ids"], data["input_ids"].long())
    assert len(batch.untrusted) == num_gb
    for g in range(num_gb):
        rows_g = {k: v[g * gbs_per_dp : (g + 1) * gbs_per_dp] for k, v in batch.data.items()}
        assert batch.untrusted[g] == nonfinite_loss_input(rows_g)
        assert batch.reason_untrusted(g) == batch.untrusted[g]
    assert batch.reason_untrusted(num_gb) is None  # a rank with fewer rows
    read = bool(batch.data["token_mask"][bad_row, s - 1]) and s - 1 < int(
        data["input_lengths"][bad_row]
    )
    assert (batch.untrusted[bad_row // gbs_per_dp] is not None) == read


@given(st.integers(2, 8), st.integers(1, 20))
def test_check_train_batch_refuses_a_gbs_that_dp_does_not_divide(dp, gbs):
    data = _train_data(0, 4, 5)
    kwargs = {
        "vocab_size": 50,
        "dp_size": dp,
        "gbs": gbs,
        "mbs": 1,
        "default_gbs": 4,
        "default_mbs": 1,
    }
    if gbs % dp:
        with pytest.raises(
            DataError,
            match=rf"train\(gbs={gbs}\) must be a multiple of the data-parallel size {dp}",
        ):
            check_train_batch(data, NLLLoss(), **kwargs)
    else:
        assert check_train_batch(data, NLLLoss(), **kwargs).gbs == gbs


def test_check_train_batch_checks_the_loss_and_its_keys_first():
    data = _train_data(0, 4, 5)
    kwargs = {
        "vocab_size": 50,
        "dp_size": 1,
        "gbs": 4,
        "mbs": 1,
        "default_gbs": 4,
        "default_mbs": 1,
    }
    with pytest.raises(ValueError, match="loss_fn is None"):
        check_train_batch(data, None, **kwargs)
    del data["token_mask"]
    with pytest.raises(DataError, match=r"missing 1 required key\(s\) \['token_mask'\]"):
        check_train_batch(data, NLLLoss(), **kwargs)

"""Properties of policyworker.functional.loss_protocol: check_loss_output, and loss_type_of /
input_type_of reading a loss's enums by value."""

import enum
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.loss_protocol import (
    LossInputType,
    LossType,
    check_loss_output,
    input_type_of,
    loss_type_of,
)

FLOATS = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])
COUNTS = st.one_of(st.integers(0, 10**6), st.floats(0, 1e6), st.just(torch.tensor(3.0)))


@given(FLOATS, COUNTS, st.booleans(), st.booleans())
def test_a_loss_that_keeps_the_contract_comes_back_unchanged(dtype, count, as_list, needs_grad):
    loss = torch.zeros((), dtype=dtype, requires_grad=True) * 2
    metrics = {"num_valid_samples": count, "loss": 0.5}
    output = [loss, metrics] if as_list else (loss, metrics)
    got = check_loss_output(output, owner="loss_fn L", needs_grad=needs_grad)
    assert got[0] is loss and got[1] == metrics and got[1] is not metrics


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), FLOATS)
def test_a_loss_that_is_not_0_d_is_refused_with_its_shape(shape, dtype):
    loss = torch.zeros(shape, dtype=dtype, requires_grad=True)
    with pytest.raises(
        ValueError, match=rf"returned loss a tensor of shape \({shape[0]},.*expected a 0-d"
    ):
        check_loss_output((loss, {"num_valid_samples": 1}), owner="loss_fn L", needs_grad=True)


@given(st.sampled_from([torch.int64, torch.bool, torch.complex64]))
def test_a_loss_that_is_not_real_floating_point_is_refused(dtype):
    with pytest.raises(ValueError, match=rf"dtype {dtype}; expected a 0-d floating-point tensor"):
        check_loss_output(
            (torch.zeros((), dtype=dtype), {"num_valid_samples": 1}), owner="L", needs_grad=False
        )


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.tuples(st.integers()),
        st.tuples(st.integers(), st.integers(), st.integers()),
    )
)
def test_anything_but_a_pair_is_refused_as_not_a_tuple(output):
    with pytest.raises(ValueError, match=r"^L returned .*; expected a tuple \(loss, metrics\)"):
        check_loss_output(output, owner="L", needs_grad=False)


@given(st.one_of(st.none(), st.text(max_size=3), st.booleans(), st.just(torch.zeros(2))))
def test_metrics_without_a_numeric_count_are_refused_naming_the_keys(count):
    metrics = {"loss": 1.0} if count is None else {"loss": 1.0, "num_valid_samples": count}
    with pytest.raises(ValueError, match=r"without a number under 'num_valid_samples' \(keys: \["):
        check_loss_output((torch.zeros(()), metrics), owner="L", needs_grad=False)


def test_a_loss_without_grad_is_refused_only_when_training():
    output = (torch.zeros(()), {"num_valid_samples": 1})
    assert check_loss_output(output, owner="L", needs_grad=False) == output
    with pytest.raises(ValueError, match="does not require grad"):
        check_loss_output(output, owner="L", needs_grad=True)


class _Foreign:
    """A loss module's own enums of our values, as NeMo-RL's loss modules define them."""

    class LossType(enum.Enum):
        TOKEN_LEVEL = "token_level"
        SEQUENCE_LEVEL = "sequence_level"

    class LossInputType(enum.Enum):
        LOGIT = "logit"
        LOGPROB = "logprob"
        DISTILLATION = "distillation"
        DRAFT = "draft"


@given(
    st.sampled_from(list(LossType)),
    st.sampled_from(list(LossInputType)),
    st.sampled_from(["ours", "foreign", "text"]),
)
def test_loss_and_input_types_are_read_by_value(loss_type, input_type, spelling):
    def spell(member, foreign_enum):
        if spelling == "ours":
            return member
        return foreign_enum(member.value) if spelling == "foreign" else member.value

    loss = SimpleNamespace(
        loss_type=spell(loss_type, _Foreign.LossType),
        input_type=spell(input_type, _Foreign.LossInputType),
    )
    assert loss_type_of(loss) is loss_type
    assert input_type_of(loss) is input_type


@given(st.sampled_from([_Foreign.LossInputType.DRAFT, "draft", None, 3]), st.booleans())
def test_an_input_type_we_cannot_feed_is_refused_with_the_known_values(value, swapped):
    loss = SimpleNamespace(
        loss_type=LossInputType.LOGIT if swapped else value,
        input_type=LossType.TOKEN_LEVEL if swapped else value,
    )
    with pytest.raises(ValueError, match=r"input_type is .*expected a LossInputType \(value one"):
        input_type_of(loss)
    with pytest.raises(ValueError, match=r"loss_type is .*'token_level', 'sequence_level'"):
        loss_type_of(loss)

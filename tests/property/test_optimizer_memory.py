"""Properties of policyworker.functional.optimizer_memory: the counts equal the state the real
torch optimizers allocate, factored state adds over parameters and never exceeds AdamW's, and
only the class name (not its module) matters."""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from policyworker.functional.optimizer_memory import (
    DEFAULT_DENSE_STATES,
    OptimizerMemory,
    factored_state_elements,
    optimizer_memory,
)
from tests.property.strategies import SEEDS, seeded_randn

param_shapes = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)
# Parameters whose row and column statistics cannot have the parameter's own shape (a matrix
# with one column has a row statistic shaped like it), so a "parameter-sized" state is dense.
matrix_shapes = st.lists(st.integers(2, 6), min_size=2, max_size=3).map(tuple)


def _stepped_state(cls: type, kwargs: dict, shapes: list[tuple[int, ...]], seed: int) -> list:
    """The per-parameter state of `cls(**kwargs)` after one step on parameters of `shapes`."""
    params = [
        torch.nn.Parameter(seeded_randn(seed + i, shape, torch.float64))
        for i, shape in enumerate(shapes)
    ]
    optimizer = cls(params, **kwargs)
    for i, p in enumerate(params):
        p.grad = seeded_randn(seed + 100 + i, p.shape, torch.float64)
    optimizer.step()
    return [optimizer.state[p] for p in params]


@given(shapes=st.lists(param_shapes, min_size=1, max_size=6), seed=SEEDS)
@example(shapes=[(), (1,), (1, 1), (3, 1), (1, 4)], seed=0)
def test_factored_elements_equal_torch_adafactors_state(shapes, seed):
    states = _stepped_state(torch.optim.Adafactor, {}, shapes, seed)
    held = sum(v.numel() for state in states for k, v in state.items() if k != "step")
    assert factored_state_elements(shapes) == held


@given(a=st.lists(param_shapes, max_size=6), b=st.lists(param_shapes, max_size=6))
def test_factored_elements_add_over_parameters_and_never_exceed_two_moments(a, b):
    assert factored_state_elements(a + b) == factored_state_elements(a) + factored_state_elements(b)
    assert factored_state_elements(a) <= 2 * sum(math.prod(s) for s in a)


OPTIMIZER_KWARGS = st.sampled_from(
    [
        ("Adam", {}),
        ("Adam", {"amsgrad": True}),
        ("AdamW", {}),
        ("AdamW", {"amsgrad": True}),
        ("Adamax", {}),
        ("NAdam", {}),
        ("RAdam", {}),
        ("Adadelta", {}),
        ("Rprop", {}),
        ("Adagrad", {}),
        ("ASGD", {}),
        ("RMSprop", {}),
        ("RMSprop", {"momentum": 0.9}),
        ("RMSprop", {"momentum": 0.9, "centered": True}),
        ("SGD", {"lr": 0.1}),
        ("SGD", {"lr": 0.1, "momentum": 0.9}),
        ("Adafactor", {}),
        ("Adafactor", {"foreach": True}),
    ]
)


@given(choice=OPTIMIZER_KWARGS, shapes=st.lists(matrix_shapes, min_size=1, max_size=3), seed=SEEDS)
def test_dense_states_count_the_parameter_sized_tensors_torch_allocates(choice, shapes, seed):
    name, kwargs = choice
    states = _stepped_state(getattr(torch.optim, name), kwargs, shapes, seed)
    for shape, state in zip(shapes, states, strict=True):
        sized = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == shape]
        assert optimizer_memory(f"torch.optim.{name}", kwargs).dense_states == len(sized), sized


@given(
    choice=OPTIMIZER_KWARGS,
    module=st.from_regex(r"[a-z][a-z_]{0,8}(\.[a-z][a-z_]{0,8}){0,2}", fullmatch=True),
)
def test_only_the_class_name_matters_not_its_module(choice, module):
    name, kwargs = choice
    assert optimizer_memory(f"{module}.{name}", kwargs) == optimizer_memory(
        f"torch.optim.{name}", kwargs
    )


@given(name=st.from_regex(r"[a-z]{1,8}\.[A-Z][A-Za-z0-9]{0,12}", fullmatch=True))
def test_an_unknown_optimizer_counts_as_adamw(name):
    known = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "Adagrad"}
    known |= {"ASGD", "RMSprop", "SGD", "Adafactor"}
    if name.rpartition(".")[2] in known:
        return
    assert optimizer_memory(name, {}) == OptimizerMemory(dense_states=DEFAULT_DENSE_STATES)
    assert optimizer_memory(name, {}) == optimizer_memory("torch.optim.AdamW", {})


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, OptimizerMemory(dense_states=0, factored=True, per_tensor_update=True)),
        ({"foreach": True}, OptimizerMemory(dense_states=0, factored=True)),
        # transformers' Adafactor: beta1 adds a first moment, factored=False a dense second one
        ({"beta1": 0.9}, OptimizerMemory(dense_states=1, factored=True, per_tensor_update=True)),
        ({"factored": False}, OptimizerMemory(dense_states=1, per_tensor_update=True)),
    ],
)
def test_adafactor_kwargs_set_its_state_and_update(kwargs, expected):
    assert optimizer_memory("transformers.optimization.Adafactor", kwargs) == expected

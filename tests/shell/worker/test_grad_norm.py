"""total_grad_norm / clip_grads_ in one process: the float64 reference norm, clipping, dtypes.

(The sharded cases, DTensor grads over a gloo mesh: tests/distributed/test_collectives_gloo.py.)"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.shell.parallel import collectives
from policyworker.shell.parallel.context import ParallelContext


def _params(shapes, seed, dtype=torch.float32, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=generator) * scale).to(dtype)
        params.append(p)
    return params


def _reference(params):
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))


SHAPES = st.lists(
    st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=6
)


@settings(deadline=None, max_examples=40)
@given(SHAPES, st.integers(0, 2**16), st.sampled_from([1e-3, 1.0, 1e3]))
def test_norm_matches_the_float64_reference(shapes, seed, scale):
    params = _params(shapes, seed, scale=scale)
    norm = collectives.total_grad_norm(params, ParallelContext.single(torch.device("cpu")))
    assert norm.dtype == torch.float32 and norm.shape == ()
    assert float(norm) == pytest.approx(_reference(params), rel=1e-5, abs=1e-30)


def test_params_without_grads_are_skipped_and_none_at_all_gives_zero():
    params = _params([(3,), (4, 2)], seed=0)
    frozen = torch.nn.Parameter(torch.ones(5))
    ctx = ParallelContext.single(torch.device("cpu"))
    assert float(collectives.total_grad_norm([*params, frozen], ctx)) == pytest.approx(
        _reference(params), rel=1e-6
    )
    assert float(collectives.total_grad_norm([frozen], ctx)) == 0.0


def test_bf16_grads_are_normed_in_fp32():
    # sqrt(4097) = 64.0078...: a bf16 norm would round it to 64 (bf16 ulp at 64 is 0.5)
    p = torch.nn.Parameter(torch.zeros(4097, dtype=torch.bfloat16))
    p.grad = torch.ones(4097, dtype=torch.bfloat16)
    norm = collectives.total_grad_norm([p], ParallelContext.single(torch.device("cpu")))
    assert float(norm) == pytest.approx(math.sqrt(4097), rel=1e-6)


def test_clip_scales_every_grad_to_the_max_norm_and_leaves_small_norms_alone():
    ctx = ParallelContext.single(torch.device("cpu"))
    params = _params([(5,), (2, 3), (7,)], seed=3)
    before = [p.grad.clone() for p in params]
    norm = collectives.total_grad_norm(params, ctx)
    collectives.clip_grads_(params, 0.5 * float(norm), norm)
    coef = 0.5 * float(norm) / (float(norm) + 1e-6)
    for p, g in zip(params, before, strict=True):
        torch.testing.assert_close(p.grad, g * coef)
    assert float(collectives.total_grad_norm(params, ctx)) == pytest.approx(
        0.5 * float(norm), rel=1e-5
    )
    clipped = [p.grad.clone() for p in params]
    collectives.clip_grads_(params, 10 * float(norm), collectives.total_grad_norm(params, ctx))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, clipped, strict=True))


def test_clip_leaves_grads_alone_for_a_non_finite_norm():
    params = _params([(4,)], seed=1)
    before = params[0].grad.clone()
    collectives.clip_grads_(params, 1.0, torch.tensor(float("inf")))
    assert torch.equal(params[0].grad, before)

"""Properties of `functional.logprobs.token_entropy` and its vocab-parallel partials."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional import vocab_parallel as vp
from policyworker.functional.logprobs import token_entropy
from tests.property.strategies import SEEDS, seeded_randn

TEMPERATURES = st.one_of(st.just(1.0), st.floats(0.25, 4.0))


@st.composite
def logits_cases(draw, *, dtypes=(torch.float32, torch.bfloat16, torch.float64)):
    """Seeded logits [B, S, V] at a drawn scale (30: peaked rows, where entropy nears 0)."""
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 40)))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 30.0]))
    return (scale * seeded_randn(draw(SEEDS), shape)).to(draw(st.sampled_from(dtypes)))


def reference_entropy(logits, temperature=1.0):
    """-sum p log p of softmax(logits / T) in float64, unchunked."""
    x = logits.double() / temperature
    return -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)


@given(logits=logits_cases(), temperature=TEMPERATURES)
def test_token_entropy_is_the_softmax_entropy(logits, temperature):
    got = token_entropy(logits, temperature=temperature)
    assert got.dtype == torch.float32 and got.shape == logits.shape[:2]
    torch.testing.assert_close(got.double(), reference_entropy(logits, temperature), **_tol())


@settings(max_examples=40)
@given(logits=logits_cases(), chunk=st.integers(1, 10), temperature=TEMPERATURES)
def test_the_chunk_size_changes_nothing(logits, chunk, temperature):
    whole = token_entropy(logits, temperature=temperature, chunk_size=logits.shape[1])
    assert torch.equal(token_entropy(logits, temperature=temperature, chunk_size=chunk), whole)


@given(logits=logits_cases(dtypes=(torch.float64,)), shift=st.floats(-50, 50), seed=SEEDS)
def test_a_shift_or_a_permutation_of_the_vocab_leaves_it_unchanged(logits, shift, seed):
    base = token_entropy(logits)
    order = torch.randperm(logits.shape[-1], generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(token_entropy(logits + shift), base, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(token_entropy(logits[..., order]), base, atol=1e-6, rtol=1e-6)


@given(logits=logits_cases(), temperature=TEMPERATURES)
def test_it_lies_between_zero_and_log_v(logits, temperature):
    got = token_entropy(logits, temperature=temperature)
    assert bool((got >= -1e-5).all()) and bool((got <= math.log(logits.shape[-1]) + 1e-4).all())


@given(logits=logits_cases(dtypes=(torch.float64,)), seed=SEEDS)
def test_a_masked_token_drops_out_of_the_entropy(logits, seed):
    """-inf logits (probability 0) add nothing; the rest is the entropy over the others."""
    V = logits.shape[-1]
    keep = torch.rand(V, generator=torch.Generator().manual_seed(seed)) < 0.7
    keep[0] = True
    masked = logits.masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(token_entropy(masked), token_entropy(logits[..., keep]).float())


@given(logits=logits_cases(), num_shards=st.integers(1, 7), temperature=TEMPERATURES)
def test_vocab_shards_partials_reduce_to_the_whole_vocab_entropy(logits, num_shards, temperature):
    """What tensor-parallel ranks compute (some shards may be empty), reduced as the all-reduces
    (MAX, then SUM) do, equals the entropy of the whole vocab."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    V = x.shape[-1]
    shards = [x[..., slice(*vp.vocab_range(r, num_shards, V))] for r in range(num_shards)]
    global_max = torch.stack([vp.local_max(s) for s in shards]).amax(0)
    sum_exp = torch.stack([vp.local_sum_exp(s, global_max) for s in shards]).sum(0)
    centred = torch.stack([vp.local_sum_exp_centered(s, global_max) for s in shards]).sum(0)
    got = vp.entropy_from_partials(sum_exp, centred)
    torch.testing.assert_close(got.double(), reference_entropy(logits, temperature), **_tol())


def test_the_logits_are_not_changed_and_gradients_flow():
    logits = seeded_randn(3, (2, 4, 9)).requires_grad_()
    before = logits.detach().clone()
    token_entropy(logits, temperature=0.5, chunk_size=3).sum().backward()
    assert torch.equal(logits.detach(), before) and logits.grad is not None
    ref = logits.detach().double().requires_grad_()
    reference_entropy(ref, 0.5).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("logits", "kwargs", "match"),
    [
        (torch.zeros(2, 3), {}, r"must be a floating \[B, S, V\] tensor"),
        (torch.zeros(1, 2, 3, dtype=torch.int64), {}, "must be a floating"),
        (torch.zeros(1, 2, 0), {}, "with V >= 1"),
        (torch.zeros(1, 2, 3), {"temperature": 0.0}, "temperature 0.0 must be a finite number"),
        (torch.zeros(1, 2, 3), {"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_arguments_name_the_rule(logits, kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_entropy(logits, **kwargs)


def _tol():
    # the result is fp32; bf16 inputs are exact after the cast, so only fp32 rounding remains
    return {"atol": 2e-5, "rtol": 2e-5}

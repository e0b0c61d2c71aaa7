"""Fused (inductor-compiled) next-token logprob kernels against the eager pair, on CPU.

Compiling dominates the run time, so the compiled pair is built once per module (and once per
process by `compiled_once`) and each test reuses its graphs.
"""

import pytest
import torch

from policyworker.functional import logprobs as lp
from policyworker.functional.logprob_kernels import (
    EAGER_KERNELS,
    plain_logprob_grad,
    plain_logprobs_and_lse,
)
from policyworker.functional.sampling import Sampling
from policyworker.shell.kernels import fused_logprobs
from policyworker.shell.kernels.fused_logprobs import (
    LOGPROB_ATOL,
    LOGPROB_RTOL,
    assert_logprob_grads_close,
    fused_logprob_kernels,
)

VOCAB = 97


def _kernels(mode, logits_dtype=torch.float32):
    return fused_logprob_kernels(
        mode,
        device=torch.device("cpu"),
        vocab_size=VOCAB,
        logits_dtype=logits_dtype,
        temperature=1.0,
    )


@pytest.fixture(scope="module")
def fused():
    kernels, reason = _kernels("layer", torch.bfloat16)
    assert reason is None and kernels.name == "fused" and kernels.whole
    return kernels


def _scored(kernels, logits, ids, weights, temperature):
    x = logits.clone().requires_grad_()
    out = lp.next_token_logprobs(
        x, ids, sampling=Sampling(temperature=temperature), kernels=kernels
    )
    (out * weights).sum().backward()
    return out, x.grad


def assert_scored_grads_close(got_grad, want_grad, logits, weights, temperature):
    """`_scored`'s gradients within the documented bound (the last position has no target, so
    its upstream gradient is 0)."""
    upstream = torch.nn.functional.pad(weights, (0, 1))
    assert_logprob_grads_close(
        got_grad, want_grad, logits=logits, grad=upstream, temperature=temperature
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "positions"), [(1, 9), (3, 5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_kernels_match_eager_values_and_gradients(fused, dtype, rows, positions, temperature):
    gen = torch.Generator().manual_seed(rows * 100 + positions)
    logits = (5 * torch.randn(rows, positions, VOCAB, generator=gen)).to(dtype)
    ids = torch.randint(0, VOCAB, (rows, positions), generator=gen)
    weights = torch.randn(rows, positions - 1, generator=gen)
    want, want_grad = _scored(EAGER_KERNELS, logits, ids, weights, temperature)
    got, got_grad = _scored(fused, logits, ids, weights, temperature)
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    assert got_grad.dtype == dtype
    assert_scored_grads_close(got_grad, want_grad, logits, weights, temperature)
    assert torch.equal(got_grad[:, -1], torch.zeros_like(got_grad[:, -1]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_entropy_matches_eager_over_all_positions_at_once(fused, temperature):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, VOCAB, generator=gen) * torch.tensor([0.1, 5.0, 40.0])[:, None, None]
    logits = logits.to(torch.bfloat16)
    want = lp.token_entropy(logits, temperature=temperature, chunk_size=2)
    got = lp.token_entropy(logits, temperature=temperature, kernels=fused)  # one call
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)


def test_top_k_top_p_stay_on_the_eager_filtered_path(fused):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, VOCAB, generator=gen)
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen)
    sampling = Sampling(top_k=5, top_p=0.9)
    got = lp.next_token_logprobs(logits, ids, sampling=sampling, kernels=fused)
    assert torch.equal(got, lp.next_token_logprobs(logits, ids, sampling=sampling))


def test_fusion_off_keeps_the_eager_pair():
    kernels, reason = _kernels("none")
    assert kernels is EAGER_KERNELS and reason is None


def test_a_compile_failure_falls_back_to_eager_and_names_the_reason(monkeypatch):
    def broken(_key, _fn):
        def call(*_a, **_k):
            raise RuntimeError("no inductor today")

        return call

    monkeypatch.setattr(fused_logprobs, "compiled_once", broken)
    with pytest.warns(RuntimeWarning, match="fused logprob kernels fell back to eager"):
        kernels, reason = _kernels("layer")
    assert kernels is EAGER_KERNELS and reason == "RuntimeError: no inductor today"


def test_the_gradient_bound_takes_rounding_and_rejects_real_errors():
    """The bound admits what another fp32 order does (the lse shifted by a few of its ulps) and
    rejects a 1e-4 relative error in the softmax and a missing 1/T."""
    gen = torch.Generator().manual_seed(11)
    temperature = 0.7
    logits = 5 * torch.randn(2, 4, VOCAB, generator=gen)
    ids = torch.randint(0, VOCAB, (2, 4), generator=gen)
    grad = torch.randn(2, 4, generator=gen)
    _, lse = plain_logprobs_and_lse(logits, ids, temperature)
    want = plain_logprob_grad(logits, ids, lse, grad, temperature)
    ulp = (torch.nextafter(lse, torch.full_like(lse, float("inf"))) - lse).abs()
    reordered = plain_logprob_grad(logits, ids, lse + 2 * ulp, grad, temperature)
    assert not torch.equal(reordered, want)
    assert_logprob_grads_close(reordered, want, logits=logits, grad=grad, temperature=temperature)
    off = plain_logprob_grad(logits, ids, lse + 1e-4, grad, temperature)
    with pytest.raises(AssertionError, match="logprob gradients differ"):
        assert_logprob_grads_close(off, want, logits=logits, grad=grad, temperature=temperature)
    no_temperature = want * temperature
    with pytest.raises(AssertionError, match="worst at"):
        assert_logprob_grads_close(
            no_temperature, want, logits=logits, grad=grad, temperature=temperature
        )

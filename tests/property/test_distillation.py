"""Properties of the distillation inputs and loss (NeMo-RL's top-k KL)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.distillation import (
    DistillationLossFn,
    distillation_topk_logprobs,
)
from tests.property.strategies import SEEDS

shapes = st.tuples(st.integers(1, 3), st.integers(2, 6), st.integers(2, 12), st.integers(1, 4))


def _case(seed, b, s, v, k):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(b, s, v, generator=gen, dtype=torch.float64)
    teacher = torch.randn(b, s, v, generator=gen, dtype=torch.float64)
    top = torch.topk(teacher, min(k, v), dim=-1)
    return student, top.values, top.indices


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, shape=shapes)
def test_topk_logprobs_normalize_and_match_the_full_softmax(seed, shape):
    student, t_vals, t_ids = _case(seed, *shape)
    s, t, h = distillation_topk_logprobs(
        student, t_vals, t_ids, zero_outside_topk=False, calculate_entropy=False
    )
    b, seq, _, _ = shape
    assert s.shape == t.shape == (b, seq - 1, t_ids.shape[-1]) and h is None
    torch.testing.assert_close(s.exp().sum(-1), torch.ones(b, seq - 1, dtype=s.dtype))
    torch.testing.assert_close(t.exp().sum(-1), torch.ones(b, seq - 1, dtype=t.dtype))
    full, _, entropy = distillation_topk_logprobs(
        student, t_vals, t_ids, zero_outside_topk=True, calculate_entropy=True
    )
    logp = torch.log_softmax(student, -1)
    torch.testing.assert_close(full, logp.gather(-1, t_ids)[:, :-1])
    assert entropy is not None
    torch.testing.assert_close(entropy, (logp.exp() * logp).sum(-1)[:, :-1])
    assert bool((full.exp().sum(-1) <= 1 + 1e-9).all())


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, shape=shapes, dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_the_student_topk_logprobs_equal_those_of_the_whole_block_cast_up_bit_for_bit(
    seed, shape, dtype
):
    """The default path gathers the K logits before the fp32 cast: values and gradients are
    those of casting the whole [B, S, V] block first (the reference below)."""
    student, t_vals, t_ids = _case(seed, *shape)
    logits = student.to(dtype)
    weights = torch.randn((shape[0], shape[1] - 1, t_ids.shape[-1]), dtype=torch.float64)
    got_x, want_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, _, _ = distillation_topk_logprobs(
        got_x, t_vals, t_ids, zero_outside_topk=False, calculate_entropy=False
    )
    want = torch.log_softmax(want_x.float().gather(-1, t_ids), dim=-1)[:, :-1]
    assert torch.equal(got, want)
    (got * weights.float()).sum().backward()
    (want * weights.float()).sum().backward()
    assert got_x.grad is not None and got_x.grad.dtype == dtype
    assert torch.equal(got_x.grad, want_x.grad)


@settings(max_examples=40, deadline=None)
@given(
    seed=SEEDS,
    shape=shapes,
    chunk=st.integers(1, 7),
    entropy_weight=st.sampled_from([None, 0.0, 1.3]),
)
def test_zero_outside_topk_values_and_gradients_match_the_full_log_softmax(
    seed, shape, chunk, entropy_weight
):
    """The chunked full-vocab normalizer and H_all (no fp32 [B, S, V] kept) against autograd of
    the plain float64 log_softmax, at any chunk size, with or without the entropy term."""
    student, t_vals, t_ids = _case(seed, *shape)
    gen = torch.Generator().manual_seed(seed + 7)
    weights = torch.randn((shape[0], shape[1] - 1, t_ids.shape[-1]), generator=gen).double()
    got_x, want_x = student.clone().requires_grad_(), student.clone().requires_grad_()
    got, _, got_h = distillation_topk_logprobs(
        got_x,
        t_vals,
        t_ids,
        zero_outside_topk=True,
        calculate_entropy=entropy_weight is not None,
        chunk_size=chunk,
    )
    assert torch.equal(got_x.detach(), student)  # the chunks' scratch is a copy
    logp = torch.log_softmax(want_x, -1)
    want, want_h = logp.gather(-1, t_ids)[:, :-1], (logp.exp() * logp).sum(-1)[:, :-1]
    torch.testing.assert_close(got, want)
    got_loss, want_loss = (got * weights).sum(), (want * weights).sum()
    if entropy_weight is not None:
        assert got_h is not None
        torch.testing.assert_close(got_h, want_h)
        got_loss, want_loss = (
            got_loss + entropy_weight * got_h.sum(),
            (want_loss + entropy_weight * want_h.sum()),
        )
    got_loss.backward()
    want_loss.backward()
    torch.testing.assert_close(got_x.grad, want_x.grad)


@settings(max_examples=40, deadline=None)
@given(
    seed=SEEDS,
    shape=shapes,
    weight=st.floats(0, 1),
    kind=st.sampled_from(["forward", "reverse", "mixed"]),
    zero=st.booleans(),
)
def test_loss_is_non_negative_masked_and_globally_normalized(seed, shape, weight, kind, zero):
    student, t_vals, t_ids = _case(seed, *shape)
    b, seq, _, _ = shape
    s, t, h = distillation_topk_logprobs(
        student, t_vals, t_ids, zero_outside_topk=zero, calculate_entropy=zero
    )
    gen = torch.Generator().manual_seed(seed + 1)
    token_mask = (torch.rand(b, seq, generator=gen) > 0.3).double()
    data = {"token_mask": token_mask, "sample_mask": torch.ones(b, dtype=torch.float64)}
    loss_fn = DistillationLossFn(
        {"kl_type": kind, "mixed_kl_weight": weight, "zero_outside_topk": zero}
    )
    loss, metrics = loss_fn(
        data=data,
        global_valid_seqs=b,
        global_valid_toks=7.0,
        student_topk_logprobs=s,
        teacher_topk_logprobs=t,
        H_all=h,
    )
    assert float(loss) >= -1e-9 and metrics["num_valid_samples"] == b
    # garbage at masked positions cannot reach the loss
    poisoned = torch.where(token_mask[:, 1:, None] == 0, torch.full_like(s, float("nan")), s)
    again, _ = loss_fn(
        data=data,
        global_valid_seqs=b,
        global_valid_toks=7.0,
        student_topk_logprobs=poisoned,
        teacher_topk_logprobs=t,
        H_all=h,
    )
    torch.testing.assert_close(again, loss)
    halved, _ = loss_fn(
        data=data,
        global_valid_seqs=b,
        global_valid_toks=14.0,
        student_topk_logprobs=s,
        teacher_topk_logprobs=t,
        H_all=h,
    )
    torch.testing.assert_close(halved * 2, loss, rtol=1e-6, atol=1e-9)

"""Properties of policyworker.functional.logprobs, .sampling (filters) and .vocab_parallel.

Chunked logprobs, sampling filters, vocab-parallel partials.
"""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policyworker.functional import logprobs as lp
from policyworker.functional import sampling as sp
from policyworker.functional import vocab_parallel as vp
from policyworker.functional.context_parallel import gather_shards, shard_for_rank
from policyworker.functional.logprob_kernels import LogprobKernels
from policyworker.functional.sampling import Sampling
from tests.property.strategies import (
    SEEDS,
    cp_layouts,
    right_padded_batches,
    seeded_randint,
    seeded_randn,
)

TOP_KS = st.one_of(st.none(), st.integers(1, 12))
TOP_PS = st.one_of(st.just(1.0), st.floats(0.05, 1.0))
TEMPERATURES = st.one_of(st.just(1.0), st.floats(0.25, 4.0))


@st.composite
def logits_cases(
    draw, *, dtypes=(torch.float32, torch.bfloat16), max_len: int = 9, max_vocab: int = 40
):
    """(logits_BSV, token_ids_BS): seeded logits at a drawn scale; integer rounding adds ties."""
    B, S, V = (
        draw(st.integers(1, 3)),
        draw(st.integers(1, max_len)),
        draw(st.integers(2, max_vocab)),
    )
    seed = draw(SEEDS)
    logits = draw(st.sampled_from([1.0, 3.0, 30.0])) * seeded_randn(seed, (B, S, V))
    if draw(st.booleans()):
        logits = logits.round()  # many exact ties
    logits = logits.to(draw(st.sampled_from(dtypes)))
    return logits, seeded_randint(seed + 1, V, (B, S))


def reference_logprobs(logits_BSV, token_ids_BS, *, temperature=1.0, top_k=None, top_p=1.0):
    """Plain, unchunked: fp32 cast, /T, filter, log_softmax over the full tensor, gather."""
    x = sp.apply_sampling_filters(
        logits_BSV[:, :-1].float() / temperature, top_k=top_k, top_p=top_p
    )
    return torch.log_softmax(x, dim=-1).gather(-1, token_ids_BS[:, 1:, None])[..., 0]


def finite_weighted_sum(values, weights):
    """sum(values * weights) over finite entries only (filtered targets give -inf logprobs)."""
    finite = torch.isfinite(values)
    return (values.masked_fill(~finite, 0.0) * weights.masked_fill(~finite, 0.0)).sum()


# ----------------------------------------------------------------------------- next_token_logprobs


@given(case=logits_cases(), temperature=TEMPERATURES)
def test_next_token_logprobs_match_plain_log_softmax(case, temperature):
    logits, ids = case
    got = lp.next_token_logprobs(
        logits, ids, sampling=Sampling(temperature=temperature), chunk_size=None
    )
    expected = torch.log_softmax(logits.float() / temperature, -1)[:, :-1].gather(
        -1, ids[:, 1:, None]
    )[..., 0]
    assert got.dtype == torch.float32
    assert got.shape == (ids.shape[0], ids.shape[1] - 1)
    torch.testing.assert_close(got, expected)
    assert bool((got <= 0).all())


@settings(max_examples=60)
@given(
    case=logits_cases(),
    temperature=TEMPERATURES,
    top_k=TOP_KS,
    top_p=TOP_PS,
    chunk_size=st.integers(1, 10),
    seed=SEEDS,
)
def test_chunked_equals_unchunked_forward_and_gradient(
    case, temperature, top_k, top_p, chunk_size, seed
):
    """Any chunk size gives the unchunked reference's values and gradients.

    fp32 out for fp32/bf16 in.
    """
    logits, ids = case
    weights = seeded_randn(seed, (ids.shape[0], ids.shape[1] - 1))
    x_ours = logits.clone().requires_grad_()
    x_ref = logits.clone().requires_grad_()
    got = lp.next_token_logprobs(
        x_ours,
        ids,
        sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p),
        chunk_size=chunk_size,
    )
    expected = reference_logprobs(x_ref, ids, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(got, expected)
    finite_weighted_sum(got, weights).backward()
    finite_weighted_sum(expected, weights).backward()
    assert x_ours.grad is not None and x_ours.grad.dtype == logits.dtype
    # A target's gradient is w * (1 - p) / T: with p near 1 it is a difference of close fp32
    # numbers, so its absolute error scales with |w| / T, not with the (small) result.
    scale = max([1.0, *(weights.abs().flatten() / temperature).tolist()])
    tolerance = {"atol": 1e-5 * scale, "rtol": 1.3e-6} if logits.dtype == torch.float32 else {}
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **tolerance)


@given(case=logits_cases(), temperature=TEMPERATURES, seed=SEEDS)
def test_whole_block_kernels_give_the_reference_and_a_zero_last_row(case, temperature, seed):
    """Kernels run over all positions in one call (`whole`, as fused ones are) score and
    differentiate like the reference; the unscored last position gets an exactly zero row."""
    logits, ids = case
    weights = seeded_randn(seed, (ids.shape[0], ids.shape[1] - 1))
    x_ours = logits.clone().requires_grad_()
    x_ref = logits.clone().requires_grad_()
    got = lp.next_token_logprobs(
        x_ours, ids, sampling=Sampling(temperature=temperature), kernels=LogprobKernels(whole=True)
    )
    expected = reference_logprobs(x_ref, ids, temperature=temperature)
    torch.testing.assert_close(got, expected)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    assert x_ours.grad is not None
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    assert torch.equal(x_ours.grad[:, -1], torch.zeros_like(x_ours.grad[:, -1]))


@settings(max_examples=40)
@given(
    case=logits_cases(),
    chunks=st.lists(st.integers(1, 10), min_size=2, max_size=3),
    top_k=TOP_KS,
    top_p=TOP_PS,
)
def test_result_does_not_depend_on_chunk_size(case, chunks, top_k, top_p):
    logits, ids = case
    results = [
        lp.next_token_logprobs(
            logits, ids, sampling=Sampling(top_k=top_k, top_p=top_p), chunk_size=c
        )
        for c in chunks
    ]
    for other in results[1:]:
        torch.testing.assert_close(other, results[0])


@settings(max_examples=40)
@given(case=logits_cases(), temperature=st.floats(0.25, 4.0))
def test_input_logits_are_not_mutated(case, temperature):
    logits, ids = case
    before = logits.clone()
    sampling = Sampling(temperature=temperature, top_k=3, top_p=0.9)
    lp.next_token_logprobs(logits, ids, sampling=sampling, chunk_size=2)
    assert torch.equal(logits, before)


@settings(max_examples=40)
@given(case=logits_cases(), pad=st.sampled_from([-1, -100, 10**6]), seed=SEEDS)
def test_pad_targets_do_not_crash_or_disturb_valid_positions(case, pad, seed):
    logits, ids = case
    padded = ids.masked_fill(seeded_randint(seed, 2, ids.shape).bool(), pad)
    got = lp.next_token_logprobs(logits, padded, chunk_size=3)
    valid = padded[:, 1:] != pad
    expected = reference_logprobs(logits, ids)
    torch.testing.assert_close(got[valid], expected[valid])
    assert bool(torch.isfinite(got).all())


def test_single_position_gives_empty_fp32():
    got = lp.next_token_logprobs(
        torch.randn(3, 1, 7, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.long)
    )
    assert got.shape == (3, 0) and got.dtype == torch.float32


def test_saved_tensors_are_only_the_low_precision_inputs():
    """[better] memory: the autograd graph holds no fp32 [B, S, V] tensor.

    B=2, S=64, V=512, bf16 in.
    """
    B, S, V = 2, 64, 512
    logits = seeded_randn(0, (B, S, V), torch.bfloat16).requires_grad_()
    ids = seeded_randint(1, V, (B, S))
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = lp.next_token_logprobs(
            logits, ids, sampling=Sampling(temperature=0.7, top_k=50, top_p=0.9), chunk_size=8
        )
    out.masked_fill(torch.isneginf(out), 0.0).sum().backward()
    fp32_logits_bytes = B * S * V * 4
    assert sum(nbytes for _, _, nbytes in saved) < 0.55 * fp32_logits_bytes
    assert not [s for s in saved if s[0] == torch.float32 and s[1] >= B * 8 * V], saved
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_the_vocab_reduction_runs_once_per_chunk_on_chunk_shaped_blocks(monkeypatch):
    """Chunk 2 over 7 scored positions: logsumexp sees exactly 4 blocks, each at most
    [B, 2, V], and backward reuses them (no second reduction)."""
    shapes = []
    original = torch.logsumexp

    def spy(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(torch, "logsumexp", spy)
    logits = torch.randn(2, 8, 5, requires_grad=True)
    out = lp.next_token_logprobs(logits, torch.zeros(2, 8, dtype=torch.long), chunk_size=2)
    out.sum().backward()
    assert shapes == [(2, 2, 5), (2, 2, 5), (2, 2, 5), (2, 1, 5)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature 0.0 must be a finite number > 0"),
        ({"temperature": float("nan")}, "temperature nan must be"),
        ({"top_p": 0.0}, r"top_p 0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p 1.5 must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k -2 must be a positive int"),
        ({"chunk_size": 0}, "chunk_size .* 0 must be >= 1"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chunk_size = kwargs.pop("chunk_size", None)
        lp.next_token_logprobs(
            torch.randn(1, 3, 4),
            torch.zeros(1, 3, dtype=torch.long),
            sampling=Sampling(**kwargs),
            chunk_size=chunk_size,
        )


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"must be \[B, S, V\] and token_ids .* must be \[B, S\]"):
        lp.next_token_logprobs(torch.randn(1, 3, 4), torch.zeros(1, 4, dtype=torch.long))


@given(vocab_size=st.integers(1, 10**7))
@example(vocab_size=32000)
@example(vocab_size=151936)
def test_default_chunk_block_is_64_to_128_mib(vocab_size):
    chunk = lp.default_chunk_size(vocab_size)
    assert chunk >= 1 and chunk & (chunk - 1) == 0
    assert 64 * 2**20 < 4 * chunk * vocab_size <= 128 * 2**20


# ----------------------------------------------------------------------------- leading zero / -inf


@given(batch=right_padded_batches(min_len=1), seed=SEEDS)
def test_leading_zero_convention(batch, seed):
    tokens_BS, lengths_B = batch
    B, S = tokens_BS.shape
    next_BS1 = -seeded_randn(seed, (B, S - 1)).abs()
    out = lp.logprobs_with_leading_zero(next_BS1, lengths_B)
    assert out.shape == (B, S)
    for b in range(B):
        n = int(lengths_B[b])
        assert float(out[b, 0]) == 0.0
        assert torch.equal(out[b, 1:n], next_BS1[b, : max(n - 1, 0)])
        assert bool((out[b, n:] == 0).all())


def test_leading_zero_rejects_lengths_past_the_sequence():
    with pytest.raises(ValueError, match=r"input lengths \[4\] must be in \[0, S\] = \[0, 3\]"):
        lp.logprobs_with_leading_zero(torch.zeros(1, 2), torch.tensor([4]))


@given(seed=SEEDS, B=st.integers(1, 4), S=st.integers(1, 8))
def test_neg_inf_counted_at_valid_positions_and_zeroed(seed, B, S):
    values = -seeded_randn(seed, (B, S)).abs()
    values = values.masked_fill(seeded_randint(seed + 1, 3, (B, S)) == 0, float("-inf"))
    valid = seeded_randint(seed + 2, 2, (B, S)).bool()
    before = values.clone()
    clean, count = lp.count_and_zero_neg_inf(values, valid)
    assert count == int((torch.isneginf(values) & valid).sum())
    assert bool(torch.isfinite(clean).all())
    assert torch.equal(
        clean[valid & torch.isfinite(values)], values[valid & torch.isfinite(values)]
    )
    assert bool((clean[~valid] == 0).all())
    assert torch.equal(values, before)


# ----------------------------------------------------------------------------- sampling filters


@st.composite
def filter_rows(draw):
    """[N, V] fp32 rows, sometimes integer-rounded so that exact ties occur."""
    N, V = draw(st.integers(1, 4)), draw(st.integers(1, 40))
    x = draw(st.sampled_from([1.0, 4.0, 30.0])) * seeded_randn(draw(SEEDS), (N, V))
    return x.round() if draw(st.booleans()) else x


@given(x=filter_rows(), k=st.integers(1, 45))
def test_top_k_keeps_everything_at_or_above_the_kth_and_nothing_below(x, k):
    out = sp.apply_sampling_filters(x, top_k=k)
    kth = torch.topk(x, min(k, x.shape[-1]), dim=-1).values[..., -1:]
    kept = torch.isfinite(out)
    assert torch.equal(kept, x >= kth)  # ties with the k-th are kept
    assert bool((kept.sum(-1) >= min(k, x.shape[-1])).all())
    assert torch.equal(out[kept], x[kept])


@given(x=filter_rows(), top_k=TOP_KS, top_p=TOP_PS)
@example(x=torch.zeros(1, 2), top_k=None, top_p=0.3)
def test_kept_set_contains_the_max_and_renormalizes(x, top_k, top_p):
    out = sp.apply_sampling_filters(x, top_k=top_k, top_p=top_p)
    argmax = x.argmax(-1, keepdim=True)
    assert bool(torch.isfinite(out.gather(-1, argmax)).all())
    torch.testing.assert_close(torch.softmax(out, -1).sum(-1), torch.ones(x.shape[0]))


@given(x=filter_rows(), top_k=TOP_KS, top_p=st.floats(0.05, 0.999))
def test_top_p_keeps_the_smallest_set_with_mass_at_least_p(x, top_k, top_p):
    """Mass is measured on the top-k survivors' renormalized softmax, as vLLM does."""
    after_k = sp.apply_sampling_filters(x, top_k=top_k)
    probs = torch.softmax(after_k, -1)
    keep = torch.isfinite(sp.apply_sampling_filters(x, top_k=top_k, top_p=top_p))
    kept_mass = (probs * keep).sum(-1)
    assert bool((kept_mass >= top_p - 1e-5).all())
    smallest_kept = probs.masked_fill(~keep, float("inf")).amin(-1)
    dropping_it = kept_mass - smallest_kept
    single = keep.sum(-1) == 1  # the max alone is always kept, whatever its mass
    assert bool(((dropping_it < top_p + 1e-5) | single).all())


@given(x=filter_rows())
def test_no_filter_is_identity(x):
    for kwargs in (
        {},
        {"top_k": None, "top_p": 1.0},
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": x.shape[-1]},
    ):
        out = sp.apply_sampling_filters(x, **kwargs)
        assert torch.equal(out, x)
        assert out is not x


@given(x=filter_rows(), top_k=TOP_KS, top_p=TOP_PS, seed=SEEDS)
def test_filter_gradient_is_straight_through_on_kept_entries(x, top_k, top_p, seed):
    x = x.clone().requires_grad_()
    out = sp.apply_sampling_filters(x, top_k=top_k, top_p=top_p)
    weights = seeded_randn(seed, x.shape)
    keep = torch.isfinite(out)
    out.masked_fill(~keep, 0.0).mul(weights).sum().backward()
    torch.testing.assert_close(x.grad, weights * keep)


def test_filters_on_a_hand_example():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    assert torch.isfinite(sp.apply_sampling_filters(x, top_k=1)).tolist() == [
        [False, True, True, False, False]
    ]
    assert torch.isfinite(sp.apply_sampling_filters(x, top_k=3)).tolist() == [
        [False, True, True, True, False]
    ]
    # probs ~ [.053, .392, .392, .144, .020]: top-p 0.5 keeps the two 3.0s.
    kept = torch.isfinite(sp.apply_sampling_filters(x, top_p=0.5)).tolist()
    assert kept == [[False, True, True, False, False]]
    # top-p 0.3: one of the tied maxima suffices; the lower id is the one kept.
    assert torch.isfinite(sp.apply_sampling_filters(x, top_p=0.3)).tolist() == [
        [False, True, False, False, False]
    ]
    assert torch.isfinite(sp.apply_sampling_filters(torch.zeros(1, 2), top_p=0.3)).tolist() == [
        [True, False]
    ]


# ----------------------------------------------------------------------------- vocab parallel


def simulated_logprobs(logits_BSV, targets_BS, num_shards):
    """The shell's three all-reduces, done by hand over vocab_range shards."""
    V = logits_BSV.shape[-1]
    ranges = [vp.vocab_range(r, num_shards, V) for r in range(num_shards)]
    shards = [logits_BSV[..., a:b] for a, b in ranges]
    global_max = torch.stack([vp.local_max(s) for s in shards]).amax(0)  # all_reduce(MAX)
    sum_exp = torch.stack([vp.local_sum_exp(s, global_max) for s in shards]).sum(
        0
    )  # all_reduce(SUM)
    target = torch.stack(
        [
            vp.local_target_logit(s, targets_BS, vocab_start=a)
            for s, (a, _) in zip(shards, ranges, strict=True)
        ]
    ).sum(0)  # all_reduce(SUM)
    return vp.logprobs_from_partials(target, global_max, sum_exp), (
        shards,
        ranges,
        global_max,
        sum_exp,
    )


vp_cases = st.tuples(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(1, 64),
    st.integers(1, 8),
    SEEDS,
    st.sampled_from([1.0, 30.0, 1e4]),
    st.sampled_from([torch.float64, torch.float32]),
)


@given(vp_cases)
def test_sharded_logprobs_match_full_log_softmax(case):
    B, S, V, num_shards, seed, scale, dtype = case
    logits = (scale * seeded_randn(seed, (B, S, V), torch.float64)).to(dtype)
    targets = seeded_randint(seed + 1, V, (B, S))
    got, _ = simulated_logprobs(logits, targets, num_shards)
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected)
    assert bool(torch.isfinite(got).all()) and bool((got <= 0).all())


@given(vp_cases)
def test_sharded_backward_partials_match_autograd(case):
    B, S, V, num_shards, seed, scale, dtype = case
    logits = (scale * seeded_randn(seed, (B, S, V), torch.float64)).to(dtype)
    targets = seeded_randint(seed + 1, V, (B, S))
    grad_out = seeded_randn(seed + 2, (B, S), dtype)
    _, (shards, ranges, global_max, sum_exp) = simulated_logprobs(logits, targets, num_shards)
    got = torch.cat(
        [
            vp.local_logprob_grad(s, targets, a, global_max, sum_exp, grad_out)
            for s, (a, _) in zip(shards, ranges, strict=True)
        ],
        dim=-1,
    )
    leaf = logits.clone().requires_grad_()
    (torch.log_softmax(leaf, -1).gather(-1, targets[..., None])[..., 0] * grad_out).sum().backward()
    torch.testing.assert_close(got, leaf.grad)


@given(V=st.integers(0, 200), size=st.integers(1, 8))
def test_vocab_ranges_tile_the_vocab_like_torch_chunk(V, size):
    ranges = [vp.vocab_range(r, size, V) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == V
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    chunk_sizes = [c.shape[0] for c in torch.arange(V).chunk(size)] if V else []
    assert [b - a for a, b in ranges if b > a] == chunk_sizes


@given(
    V=st.integers(1, 40),
    size=st.integers(1, 6),
    rows_per_rank=st.integers(1, 4),
    seed=SEEDS,
    top_k=TOP_KS,
    top_p=TOP_PS,
)
def test_filtered_tp_all_to_all_matches_full_vocab(V, size, rows_per_rank, seed, top_k, top_p):
    """Vocab shards -> row blocks (all-to-all) -> filter + logprob per block.

    Equals the full filtered logprobs.
    """
    N = size * rows_per_rank
    full = seeded_randn(seed, (N, V))
    targets = seeded_randint(seed + 1, V, (N,))
    vocab_shards = vp.split_vocab(full, size)  # what each TP rank holds
    sent = [vp.split_rows(shard, size) for shard in vocab_shards]  # sent[src][dst]
    expected = torch.log_softmax(sp.apply_sampling_filters(full, top_k=top_k, top_p=top_p), -1)
    for rank in range(size):
        rows = vp.concat_vocab_pieces([sent[src][rank] for src in range(size)])
        start, stop = vp.rows_for_rank(N, rank, size)
        assert torch.equal(rows, full[start:stop])
        got = torch.log_softmax(sp.apply_sampling_filters(rows, top_k=top_k, top_p=top_p), -1)
        index = targets[start:stop, None]
        assert torch.equal(got.gather(-1, index), expected[start:stop].gather(-1, index))
    # and back (gradients travel row-parallel -> vocab-parallel): the round trip is exact
    row_blocks = [full[slice(*vp.rows_for_rank(N, r, size))] for r in range(size)]
    returned = [vp.split_vocab(block, size) for block in row_blocks]  # returned[src][dst]
    for rank, shard in enumerate(vocab_shards):
        assert torch.equal(torch.cat([returned[src][rank] for src in range(size)], dim=0), shard)


def test_rows_not_divisible_by_tp_names_the_fix():
    with pytest.raises(
        ValueError,
        match=(
            "rows 10 must be divisible by tensor_parallel_size 4.*make_sequence_length_divisible_by"
        ),
    ):
        vp.rows_for_rank(10, 0, 4)


def test_large_logits_stay_finite():
    logits = 100 * seeded_randn(0, (2, 6, 50))
    ids = torch.zeros(2, 6, dtype=torch.long)
    got = lp.next_token_logprobs(logits, ids, chunk_size=4)
    assert bool(torch.isfinite(got).all())
    simulated, _ = simulated_logprobs(logits[:, :-1], ids[:, 1:], 2)
    torch.testing.assert_close(got, simulated, rtol=1e-5, atol=1e-4)
    assert math.isfinite(float(got.sum()))


@given(
    B=st.integers(1, 3),
    cp_and_len=cp_layouts(max_cp=4, max_chunk=3),
    V=st.integers(2, 30),
    tp_size=st.integers(1, 4),
    seed=SEEDS,
)
def test_cp_and_vocab_parallel_composition_equals_next_token_logprobs(
    B, cp_and_len, V, tp_size, seed
):
    """CP shards of (logits, shifted_targets) scored by vocab-parallel partials.

    Gathered, last column dropped.
    """
    cp_size, S = cp_and_len
    logits = 3 * seeded_randn(seed, (B, S, V))
    ids = seeded_randint(seed + 1, V, (B, S))
    targets = lp.shifted_targets(ids, pad_id=-1)
    per_rank = []
    for cp_rank in range(cp_size):
        local_logits = shard_for_rank(logits, cp_rank=cp_rank, cp_size=cp_size)
        local_targets = shard_for_rank(targets, cp_rank=cp_rank, cp_size=cp_size)
        scored, _ = simulated_logprobs(local_logits, local_targets, tp_size)
        per_rank.append(scored)
    full = gather_shards(per_rank, cp_size=cp_size)
    torch.testing.assert_close(full[:, :-1], lp.next_token_logprobs(logits, ids))


@given(batch=right_padded_batches(min_len=1), pad_id=st.integers(-100, -1))
def test_shifted_targets_are_next_tokens_then_pad(batch, pad_id):
    tokens_BS, _ = batch
    shifted = lp.shifted_targets(tokens_BS, pad_id=pad_id)
    assert torch.equal(shifted[:, :-1], tokens_BS[:, 1:])
    assert bool((shifted[:, -1] == pad_id).all())


@settings(max_examples=40)
@given(case=logits_cases(), top_k=TOP_KS, top_p=TOP_PS, chunk_size=st.integers(1, 10), seed=SEEDS)
def test_target_logprobs_on_shifted_targets_equal_next_token_logprobs(
    case, top_k, top_p, chunk_size, seed
):
    """Unshifted scoring against shifted_targets == next_token_logprobs, values and gradients."""
    logits, ids = case
    weights = seeded_randn(seed, (ids.shape[0], ids.shape[1] - 1))
    x_target, x_next = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    kwargs = {"sampling": Sampling(top_k=top_k, top_p=top_p), "chunk_size": chunk_size}
    got = lp.target_logprobs(x_target, lp.shifted_targets(ids), **kwargs)
    expected = lp.next_token_logprobs(x_next, ids, **kwargs)
    assert got.shape == ids.shape
    torch.testing.assert_close(got[:, :-1], expected)
    finite_weighted_sum(got[:, :-1], weights).backward()
    finite_weighted_sum(expected, weights).backward()
    torch.testing.assert_close(x_target.grad, x_next.grad)


@given(top_k=st.one_of(st.none(), st.integers(-1, 12)), top_p=st.floats(0.05, 1.0), seed=SEEDS)
def test_inactive_filters_keep_every_logit(top_k, top_p, seed):
    """When sampling_filters_active says no, the filters are the identity (no mask at all)."""
    logits = seeded_randn(seed, (3, 8))
    if not sp.sampling_filters_active(top_k, top_p):
        assert sp.sampling_keep_mask(logits, top_k=top_k, top_p=top_p) is None
        assert torch.equal(sp.apply_sampling_filters(logits, top_k=top_k, top_p=top_p), logits)


@given(
    logits_shape=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    ids_shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
)
def test_logits_and_ids_are_accepted_exactly_when_b_and_s_agree(logits_shape, ids_shape):
    """[B, S, V] logits with [B, S] ids pass; any other pair of shapes names both shapes."""
    logits, ids = torch.zeros(logits_shape), torch.zeros(ids_shape, dtype=torch.long)
    if len(logits_shape) == 3 and len(ids_shape) == 2 and logits_shape[:2] == ids_shape:
        lp.check_logits_and_ids(logits, ids)
        return
    with pytest.raises(ValueError, match=r"must be \[B, S, V\] and token_ids .* must be \[B, S\]"):
        lp.check_logits_and_ids(logits, ids)

"""Properties of policyworker.functional.topk: per-shard top-k merged == global top-k, exactly."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.topk import local_topk, merge_topk, topk_logits
from policyworker.functional.vocab_parallel import vocab_range
from tests.property.strategies import SEEDS, seeded_randn


def oracle_topk(logits, k):
    """Full stable descending sort of the fp32 logits: value desc, then lower id first."""
    x = logits.float()
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return x.gather(-1, order), order


@st.composite
def topk_cases(draw, *, max_vocab: int = 64):
    """(logits [B,S,V], k): fp32 or bf16; often integer-rounded so that exact ties are common."""
    B, S, V = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, max_vocab))
    logits = draw(st.sampled_from([1.0, 3.0, 30.0])) * seeded_randn(draw(SEEDS), (B, S, V))
    if draw(st.booleans()):
        logits = logits.round()
    logits = logits.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))
    return logits, draw(st.integers(1, V))


@given(case=topk_cases(), num_shards=st.integers(1, 8))
def test_merged_shard_topk_equals_global_topk(case, num_shards):
    logits, k = case
    V = logits.shape[-1]
    parts = []
    for rank in range(num_shards):
        start, stop = vocab_range(rank, num_shards, V)  # uneven, possibly empty shards
        parts.append(local_topk(logits[..., start:stop], k, vocab_start=start))
    values, indices = merge_topk([v for v, _ in parts], [i for _, i in parts], k)
    expected_values, expected_indices = oracle_topk(logits, k)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64
    assert torch.equal(values, expected_values)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(values, torch.topk(logits.float(), k, dim=-1).values)  # exact vs torch.topk
    assert torch.equal(logits.float().gather(-1, indices), values)  # ids point at their values


@given(case=topk_cases(), num_shards=st.integers(1, 8), seed=SEEDS)
def test_merge_does_not_depend_on_shard_order(case, num_shards, seed):
    logits, k = case
    V = logits.shape[-1]
    parts = [
        local_topk(logits[..., a:b], k, vocab_start=a)
        for a, b in (vocab_range(r, num_shards, V) for r in range(num_shards))
    ]
    perm = torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed)).tolist()
    straight = merge_topk([p[0] for p in parts], [p[1] for p in parts], k)
    shuffled = merge_topk([parts[i][0] for i in perm], [parts[i][1] for i in perm], k)
    assert torch.equal(straight[0], shuffled[0]) and torch.equal(straight[1], shuffled[1])


@given(case=topk_cases(), start=st.integers(0, 1000))
def test_local_topk_takes_all_local_ids_when_k_exceeds_the_shard(case, start):
    logits, _ = case
    V = logits.shape[-1]
    values, indices = local_topk(logits, V + 5, vocab_start=start)
    assert values.shape[-1] == V
    assert torch.equal(indices.sort(-1).values, (torch.arange(V) + start).expand_as(indices))


@settings(max_examples=60)
@given(
    case=topk_cases(),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    temperature=st.one_of(st.just(1.0), st.floats(0.25, 4.0)),
)
def test_chunked_topk_logits_equal_unchunked(case, chunks, temperature):
    logits, k = case
    expected_values, expected_indices = oracle_topk(logits.float() / temperature, k)
    for chunk in [None, *chunks]:
        values, indices = topk_logits(logits, k, temperature=temperature, chunk_size=chunk)
        assert values.shape == (*logits.shape[:2], k)
        assert torch.equal(values, expected_values)
        assert torch.equal(indices, expected_indices)


@settings(max_examples=60)
@given(
    seed=SEEDS,
    rows=st.integers(1, 6),
    vocab=st.integers(40, 300),
    k=st.integers(1, 30),
    levels=st.sampled_from([2.0, 8.0, 64.0, 1e6]),
)
def test_rows_with_many_or_few_ties_at_the_kth_value_get_the_exact_order(
    seed, rows, vocab, k, levels
):
    """Logits rounded to a few levels tie far beyond k + 16 candidates at the k-th value (the
    pass over the vocab settles those rows); many levels tie rarely (the candidates do)."""
    x = (seeded_randn(seed, (1, rows, vocab)) * levels).round() / levels
    k = min(k, vocab)
    want_values, want_ids = oracle_topk(x, k)
    values, ids = topk_logits(x, k)
    assert torch.equal(values, want_values) and torch.equal(ids, want_ids)


def test_a_batch_mixing_settled_and_tied_rows_takes_the_vocab_pass_for_the_tied_only(
    monkeypatch,
):
    import policyworker.functional.topk as topk_module

    passes = []
    exact = topk_module._exact_topk
    monkeypatch.setattr(
        topk_module, "_exact_topk", lambda x, k: passes.append(x.shape[0]) or exact(x, k)
    )
    distinct = torch.randperm(200, generator=torch.Generator().manual_seed(0)).float()
    tied = torch.zeros(200)  # every id ties with the k-th value
    x = torch.stack([distinct, tied, distinct.flip(0)])[None]
    values, ids = topk_logits(x, 4)
    assert passes == [1]  # the tied row alone
    assert ids[0, 1].tolist() == [0, 1, 2, 3]
    want_values, want_ids = oracle_topk(x, 4)
    assert torch.equal(values, want_values) and torch.equal(ids, want_ids)


def test_ties_prefer_lower_ids():
    logits = torch.tensor([[[1.0, 5.0, 5.0, 2.0, 5.0]]])
    values, indices = topk_logits(logits, 2)
    assert values.tolist() == [[[5.0, 5.0]]] and indices.tolist() == [[[1, 2]]]
    merged = merge_topk(
        [torch.tensor([5.0, 2.0]), torch.tensor([5.0, 5.0])],
        [torch.tensor([4, 3]), torch.tensor([1, 2])],
        3,
    )
    assert merged[0].tolist() == [5.0, 5.0, 5.0] and merged[1].tolist() == [1, 2, 4]


def test_topk_does_not_track_gradients_or_mutate_input():
    logits = torch.randn(1, 4, 9, requires_grad=True)
    before = logits.detach().clone()
    values, _ = topk_logits(logits, 3, temperature=0.5)
    assert not values.requires_grad
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize(
    ("k", "kwargs", "match"),
    [
        (0, {}, "k 0 must be >= 1"),
        (10, {}, "k 10 exceeds the vocab size 9"),
        (2, {"temperature": 0.0}, "temperature 0.0 must be a finite number > 0"),
        (2, {"chunk_size": 0}, "chunk_size 0 must be >= 1"),
    ],
)
def test_bad_topk_arguments_are_rejected(k, kwargs, match):
    with pytest.raises(ValueError, match=match):
        topk_logits(torch.randn(1, 2, 9), k, **kwargs)


def test_merge_rejects_too_few_candidates_and_mismatched_lists():
    with pytest.raises(ValueError, match="k 3 exceeds the 2 candidates"):
        merge_topk(
            [torch.zeros(1), torch.zeros(1)],
            [torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)],
            3,
        )
    with pytest.raises(ValueError, match="one \\(values, indices\\) pair per shard"):
        merge_topk([torch.zeros(1)], [], 1)

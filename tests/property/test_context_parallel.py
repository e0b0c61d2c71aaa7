"""Properties of policyworker.functional.context_parallel (head-tail load-balanced CP shards)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.context_parallel import (
    cp_chunk_ids,
    cp_position_ids,
    gather_shards,
    load_balanced_to_contiguous,
    shard_for_rank,
)
from tests.property.strategies import SEEDS, cp_layouts, seeded_randn


@st.composite
def cp_tensors(draw):
    """(x, cp_size, dim): a random tensor whose dim `dim` is a multiple of 2 * cp_size."""
    cp_size, seq_len = draw(cp_layouts())
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = seq_len
    return seeded_randn(draw(SEEDS), tuple(shape)), cp_size, dim


def test_worked_example():
    x = torch.arange(8)[None, :]
    shards = [shard_for_rank(x, cp_rank=r, cp_size=2) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 6, 7]]
    assert shards[1].tolist() == [[2, 3, 4, 5]]
    assert load_balanced_to_contiguous(shards, cp_rank=1, cp_size=2).tolist() == [[4, 5, 6, 7]]
    assert cp_chunk_ids(0, 2) == (0, 3)
    assert cp_chunk_ids(1, 2) == (1, 2)


@given(cp_tensors())
def test_shard_then_gather_is_identity(case):
    x, cp_size, dim = case
    shards = [shard_for_rank(x, cp_rank=r, cp_size=cp_size, dim=dim) for r in range(cp_size)]
    assert torch.equal(gather_shards(shards, cp_size=cp_size, dim=dim), x)


@given(cp_tensors())
def test_cp_size_one_is_identity(case):
    x, _, dim = case  # dim's length is a multiple of 2 * cp_size, hence even
    assert torch.equal(shard_for_rank(x, cp_rank=0, cp_size=1, dim=dim), x)
    assert torch.equal(load_balanced_to_contiguous([x], cp_rank=0, cp_size=1, dim=dim), x)


@given(cp_layouts())
def test_shards_balance_causal_work(layout):
    """Head-tail balancing: the sum of positions (~ causal attention cost) is equal on every
    rank."""
    cp_size, seq_len = layout
    costs = {
        int(cp_position_ids(seq_len, cp_rank=r, cp_size=cp_size).sum()) for r in range(cp_size)
    }
    assert len(costs) == 1


@given(cp_layouts())
def test_every_position_is_owned_exactly_once(layout):
    cp_size, seq_len = layout
    owned = torch.cat(
        [cp_position_ids(seq_len, cp_rank=r, cp_size=cp_size) for r in range(cp_size)]
    )
    assert torch.equal(owned.sort().values, torch.arange(seq_len))


@given(cp_tensors())
def test_shard_of_position_ids_equals_positions_of_shard(case):
    x, cp_size, dim = case
    seq_len = x.shape[dim]
    for r in range(cp_size):
        positions = cp_position_ids(seq_len, cp_rank=r, cp_size=cp_size)
        assert torch.equal(
            shard_for_rank(x, cp_rank=r, cp_size=cp_size, dim=dim), x.index_select(dim, positions)
        )


@given(cp_tensors())
def test_load_balanced_to_contiguous_equals_plain_chunk(case):
    x, cp_size, dim = case
    shards = [shard_for_rank(x, cp_rank=r, cp_size=cp_size, dim=dim) for r in range(cp_size)]
    for r, expected in enumerate(x.chunk(cp_size, dim=dim)):
        assert torch.equal(
            load_balanced_to_contiguous(shards, cp_rank=r, cp_size=cp_size, dim=dim), expected
        )


@given(cp_tensors())
def test_shard_does_not_mutate_input(case):
    x, cp_size, dim = case
    before = x.clone()
    shard_for_rank(x, cp_rank=cp_size - 1, cp_size=cp_size, dim=dim).mul_(2)
    assert torch.equal(x, before)


def test_indivisible_sequence_names_the_fix():
    with pytest.raises(
        ValueError,
        match=r"must be divisible by 2 \* cp_size = 4; pad it .*make_sequence_length_divisible_by",
    ):
        shard_for_rank(torch.zeros(1, 6), cp_rank=0, cp_size=2)


@pytest.mark.parametrize(("rank", "size"), [(-1, 2), (2, 2), (0, 0)])
def test_bad_rank_or_size_is_rejected(rank, size):
    with pytest.raises(ValueError, match="cp_rank|cp_size"):
        cp_chunk_ids(rank, size)


def test_gather_with_wrong_shard_count_is_rejected():
    with pytest.raises(ValueError, match="got 1 shards but cp_size is 2"):
        gather_shards([torch.zeros(1, 4)], cp_size=2)
    with pytest.raises(ValueError, match="same even length"):
        gather_shards([torch.zeros(1, 4), torch.zeros(1, 2)], cp_size=2)

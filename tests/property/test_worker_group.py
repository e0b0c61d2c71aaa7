"""Properties of policyworker.functional.worker_group (the Ray group's pure arithmetic)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.worker_group import (
    dp_leader_ranks,
    local_ranks,
    version_in_range,
    version_tuple,
)

nodes = st.lists(st.sampled_from(["a", "b", "c"]), max_size=12)


@given(nodes)
def test_local_ranks_count_zero_up_on_every_node_in_global_rank_order(node_of_rank):
    ranks = local_ranks(node_of_rank)
    assert len(ranks) == len(node_of_rank)
    for node in set(node_of_rank):
        mine = [r for r, n in zip(ranks, node_of_rank, strict=True) if n == node]
        assert mine == list(range(len(mine)))


def test_local_ranks_example():
    assert local_ranks(["a", "b", "a", "a"]) == [0, 0, 1, 2]


@given(dp=st.integers(1, 8), cp=st.integers(1, 4), tp=st.integers(1, 4))
def test_dp_leaders_are_the_cp0_tp0_rank_of_every_dp_rank(dp, cp, tp):
    leaders = dp_leader_ranks(world_size=dp * cp * tp, cp_size=cp, tp_size=tp)
    assert len(leaders) == dp
    for d, rank in enumerate(leaders):  # row-major (dp, cp, tp) coordinates of the leader
        assert (rank // (cp * tp), (rank // tp) % cp, rank % tp) == (d, 0, 0)


@pytest.mark.parametrize("world,cp,tp", [(3, 1, 2), (0, 1, 1), (4, 0, 1)])
def test_dp_leaders_reject_a_world_the_block_does_not_divide(world, cp, tp):
    with pytest.raises(ValueError, match="positive multiple of cp_size"):
        dp_leader_ranks(world_size=world, cp_size=cp, tp_size=tp)


@given(
    st.lists(st.integers(0, 999), min_size=1, max_size=4),
    st.sampled_from(["", "rc1", ".dev0", "+cpu", "a2"]),
)
def test_version_tuple_reads_the_release_numbers_and_drops_any_suffix(numbers, suffix):
    text = ".".join(map(str, numbers)) + suffix
    assert version_tuple(text) == tuple(numbers)


@pytest.mark.parametrize("text", ["", "ray", "v2.1"])
def test_version_tuple_rejects_a_string_without_a_leading_number(text):
    with pytest.raises(ValueError, match="does not start with a number"):
        version_tuple(text)


@given(st.tuples(st.integers(0, 5), st.integers(0, 99), st.integers(0, 9)))
def test_version_in_range_is_the_half_open_tuple_interval(release):
    text = ".".join(map(str, release))
    assert version_in_range(text, minimum=(2, 40), below=(3,)) == ((2, 40) <= release < (3,))


def test_version_in_range_examples():
    assert version_in_range("2.60.0", minimum=(2, 40), below=(3,))
    assert not version_in_range("2.9.3", minimum=(2, 40), below=(3,))
    assert not version_in_range("3.0.0rc1", minimum=(2, 40), below=(3,))

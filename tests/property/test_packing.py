"""Properties of policyworker.functional.packing: pack/unpack, cu_seqlens, bin packing."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.packing import (
    cu_seqlens_from_lengths,
    pack,
    pack_into_bins,
    packed_position_ids,
    packed_token_slots,
    packing_efficiency,
    unpack,
)
from tests.property.strategies import SEEDS, right_padded_batches, seeded_randn

PAD = -1
ALGORITHMS = st.sampled_from(
    ["first_fit_decreasing", "modified_first_fit_decreasing", "first_fit_shuffle", "concatenative"]
)


@st.composite
def bin_problems(draw, *, max_items: int = 40):
    """(lengths, capacity): every length in [0, capacity]."""
    capacity = draw(st.integers(1, 200))
    lengths = draw(st.lists(st.integers(0, capacity), min_size=1, max_size=max_items))
    return lengths, capacity


def loads(bins, lengths):
    return [sum(lengths[i] for i in b) for b in bins]


@given(right_padded_batches())
def test_pack_unpack_round_trip(batch):
    tokens_BS, lengths_B = batch
    before = tokens_BS.clone()
    tokens_N, cu_seqlens = pack(tokens_BS, lengths_B)
    assert tokens_N.numel() == int(lengths_B.sum())
    assert (tokens_N != PAD).all()
    restored = unpack(tokens_N, cu_seqlens, seq_len=tokens_BS.shape[1], pad_value=PAD)
    assert torch.equal(restored, tokens_BS)
    assert torch.equal(tokens_BS, before)


@given(right_padded_batches())
def test_scattering_into_the_token_slots_is_unpack(batch):
    """The slots put every packed token where `unpack` puts it (host-computed index, no mask)."""
    tokens_BS, lengths_B = batch
    B, S = tokens_BS.shape
    tokens_N, cu_seqlens = pack(tokens_BS, lengths_B)
    slots = packed_token_slots(lengths_B, S)
    assert slots.dtype == torch.int64 and slots.shape == tokens_N.shape
    scattered = torch.full((B * S,), PAD, dtype=tokens_N.dtype).index_copy(0, slots, tokens_N)
    assert torch.equal(
        scattered.reshape(B, S), unpack(tokens_N, cu_seqlens, seq_len=S, pad_value=PAD)
    )


@given(right_padded_batches(), st.integers(1, 4), SEEDS)
def test_pack_unpack_round_trip_with_trailing_dims(batch, K, seed):
    """[B, S, K] tensors (e.g. top-k logits) pack per token, keeping the trailing dim."""
    _, lengths_B = batch
    B, S = len(lengths_B), batch[0].shape[1]
    mask = torch.arange(S)[None, :] < lengths_B[:, None]
    x_BSK = seeded_randn(seed, (B, S, K)).masked_fill(~mask[..., None], 0.0)
    x_NK, cu = pack(x_BSK, lengths_B)
    assert x_NK.shape == (int(lengths_B.sum()), K)
    assert torch.equal(unpack(x_NK, cu, seq_len=S), x_BSK)


@given(right_padded_batches())
def test_cu_seqlens_are_int32_cumulative_lengths(batch):
    _, lengths_B = batch
    cu = cu_seqlens_from_lengths(lengths_B)
    assert cu.dtype == torch.int32 and cu.shape == (len(lengths_B) + 1,)
    assert int(cu[0]) == 0 and int(cu[-1]) == int(lengths_B.sum())
    assert torch.equal((cu[1:] - cu[:-1]).long(), lengths_B)


@given(right_padded_batches())
def test_packed_position_ids_restart_at_zero_per_sequence(batch):
    _, lengths_B = batch
    expected = [p for n in lengths_B.tolist() for p in range(n)]
    pos = packed_position_ids(lengths_B)
    assert pos.dtype == torch.int64 and pos.tolist() == expected


@given(bin_problems(), ALGORITHMS, st.integers(1, 4), st.integers(1, 4), SEEDS)
def test_bins_hold_every_sequence_once_and_never_exceed_capacity(
    problem, algorithm, min_bins, multiple, seed
):
    lengths, capacity = problem
    natural = len(pack_into_bins(lengths, capacity, algorithm=algorithm, seed=seed))
    target = -(-max(natural, min_bins) // multiple) * multiple
    if target > len(lengths):
        with pytest.raises(ValueError, match=f"cannot make {target} bins"):
            pack_into_bins(
                lengths,
                capacity,
                algorithm=algorithm,
                min_bin_count=min_bins,
                bin_count_multiple=multiple,
                seed=seed,
            )
        return
    bins = pack_into_bins(
        lengths,
        capacity,
        algorithm=algorithm,
        min_bin_count=min_bins,
        bin_count_multiple=multiple,
        seed=seed,
    )
    assert len(bins) == target
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert max(loads(bins, lengths)) <= capacity
    assert len(bins) >= min_bins and len(bins) % multiple == 0
    assert len(bins) >= -(-sum(lengths) // capacity)


@given(ALGORITHMS, st.integers(1, 10_000), st.integers(1, 8), st.integers(1, 8), SEEDS)
def test_no_sequences_make_no_bins(algorithm, capacity, min_bins, multiple, seed):
    # NeMo-RL's packers return [] for an empty batch; the bin-count rules apply to real sequences
    for empty in ([], torch.zeros(0, dtype=torch.int64)):
        bins = pack_into_bins(
            empty,
            capacity,
            algorithm=algorithm,
            min_bin_count=min_bins,
            bin_count_multiple=multiple,
            seed=seed,
        )
        assert bins == []


def test_no_sequences_still_check_the_arguments():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        pack_into_bins([], 0, algorithm="concatenative")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        pack_into_bins([], 8, algorithm="best_fit")  # pyright: ignore[reportArgumentType]


@given(
    bin_problems(),
    st.sampled_from(["first_fit_decreasing", "modified_first_fit_decreasing", "first_fit_shuffle"]),
    SEEDS,
)
def test_first_fit_family_leaves_at_most_one_bin_half_empty(problem, algorithm, seed):
    """Oracle of first fit: a later bin was opened because its first item did not fit earlier."""
    lengths, capacity = problem
    bins = pack_into_bins(lengths, capacity, algorithm=algorithm, seed=seed)
    assert sum(2 * load <= capacity for load in loads(bins, lengths)) <= 1


@given(bin_problems())
def test_concatenative_keeps_input_order_and_opens_a_bin_only_when_full(problem):
    lengths, capacity = problem
    bins = pack_into_bins(lengths, capacity, algorithm="concatenative")
    assert [i for b in bins for i in b] == list(range(len(lengths)))
    for prev, nxt in zip(bins, bins[1:], strict=False):
        assert loads([prev], lengths)[0] + lengths[nxt[0]] > capacity


@given(
    bin_problems(),
    SEEDS,
    st.sampled_from(["first_fit_decreasing", "modified_first_fit_decreasing"]),
)
def test_decreasing_packers_are_invariant_to_input_order(problem, seed, algorithm):
    """The multiset of bin loads does not depend on the order the sequences arrive in."""
    lengths, capacity = problem
    shuffled = list(lengths)
    random.Random(seed).shuffle(shuffled)
    a = pack_into_bins(lengths, capacity, algorithm=algorithm)
    b = pack_into_bins(shuffled, capacity, algorithm=algorithm)
    assert sorted(loads(a, lengths)) == sorted(loads(b, shuffled))


@settings(max_examples=30)
@given(bin_problems(max_items=12), ALGORITHMS)
def test_bin_count_is_the_smallest_admissible_count_after_splitting(problem, algorithm):
    """Splitting adds exactly the bins needed for min_bin_count / bin_count_multiple."""
    lengths, capacity = problem
    natural = len(pack_into_bins(lengths, capacity, algorithm=algorithm))
    for min_bins in range(1, len(lengths) + 1):
        target = max(natural, min_bins)
        bins = pack_into_bins(lengths, capacity, algorithm=algorithm, min_bin_count=min_bins)
        assert len(bins) == target
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))


def test_mffd_worked_example_from_the_docstring():
    lengths = [46, 24, 55, 88, 11, 14, 73, 17]
    bins = pack_into_bins(lengths, 100, algorithm="modified_first_fit_decreasing")
    assert bins == [[3, 4], [6, 5], [2, 7, 1], [0]]
    assert loads(bins, lengths) == [99, 87, 96, 46]
    assert packing_efficiency(bins, lengths, 100) == pytest.approx(328 / 400)


def test_mffd_matches_or_beats_ffd_on_random_lengths():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, 800, (256,), generator=generator).tolist()
    mffd = pack_into_bins(lengths, 1200, algorithm="modified_first_fit_decreasing")
    ffd = pack_into_bins(lengths, 1200, algorithm="first_fit_decreasing")
    assert len(mffd) <= len(ffd)
    assert len(mffd) <= -(-sum(lengths) // 1200) + 2


def test_sequence_longer_than_capacity_names_index_length_capacity_and_fix():
    with pytest.raises(
        ValueError, match=r"sequence 1 has length 120, outside \[0, capacity=100\].*raise"
    ):
        pack_into_bins([10, 120], 100, algorithm="first_fit_decreasing")


def test_unreachable_bin_count_names_the_values():
    with pytest.raises(
        ValueError,
        match=r"cannot make 4 bins \(min_bin_count=3, bin_count_multiple=2"
        r".*from 3 sequences",
    ):
        pack_into_bins(
            [1, 2, 3], 100, algorithm="first_fit_decreasing", min_bin_count=3, bin_count_multiple=2
        )
    with pytest.raises(ValueError, match="algorithm must be one of"):
        pack_into_bins([1], 10, algorithm="best_fit")  # type: ignore[arg-type]


def test_unpack_rejects_cu_seqlens_that_do_not_match_the_tokens():
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] is 5"):
        unpack(torch.zeros(4), torch.tensor([0, 2, 5], dtype=torch.int32), seq_len=3)

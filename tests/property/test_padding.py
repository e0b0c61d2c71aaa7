"""Properties of policyworker.functional.padding."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from policyworker.functional.padding import (
    left_to_right_pad,
    lengths_from_mask,
    mask_from_lengths,
    position_ids_from_lengths,
    right_to_left_pad,
)
from tests.property.strategies import SEEDS, right_padded_batches, seeded_randn

PAD = -1


@given(right_padded_batches())
@example((torch.tensor([[-1, -1], [3, 4]]), torch.tensor([0, 2])))  # length-0 and full rows
def test_right_to_left_to_right_is_identity(batch):
    tokens_BS, lengths_B = batch
    before = tokens_BS.clone()
    left_BS = right_to_left_pad(tokens_BS, lengths_B, PAD)
    assert torch.equal(left_to_right_pad(left_BS, lengths_B, PAD), tokens_BS)
    assert torch.equal(tokens_BS, before)  # inputs unmutated


@given(right_padded_batches())
def test_left_row_ends_with_the_right_rows_tokens_in_order(batch):
    tokens_BS, lengths_B = batch
    left_BS = right_to_left_pad(tokens_BS, lengths_B, PAD)
    S = tokens_BS.shape[1]
    for b, n in enumerate(lengths_B.tolist()):
        assert left_BS[b, S - n :].tolist() == tokens_BS[b, :n].tolist()
        assert (left_BS[b, : S - n] == PAD).all()


@given(right_padded_batches(), st.integers(1, 3), SEEDS)
def test_padding_moves_trailing_dims_with_their_token(batch, K, seed):
    """[B, S, K] values travel with their position (e.g. top-k entries)."""
    _, lengths_B = batch
    B, S = len(lengths_B), int(batch[0].shape[1])
    x_BSK = seeded_randn(seed, (B, S, K)) * mask_from_lengths(lengths_B, S)[..., None]
    left = right_to_left_pad(x_BSK, lengths_B, 0.0)
    for b, n in enumerate(lengths_B.tolist()):
        assert torch.equal(left[b, S - n :], x_BSK[b, :n])
    assert torch.equal(left_to_right_pad(left, lengths_B, 0.0), x_BSK)


@given(right_padded_batches())
def test_lengths_from_mask_inverts_mask_from_lengths(batch):
    tokens_BS, lengths_B = batch
    mask_BS = mask_from_lengths(lengths_B, tokens_BS.shape[1])
    assert mask_BS.dtype == torch.bool
    assert torch.equal(mask_BS, tokens_BS != PAD)
    assert torch.equal(lengths_from_mask(mask_BS), lengths_B)


@given(right_padded_batches())
def test_position_ids_count_up_to_length_then_zero(batch):
    tokens_BS, lengths_B = batch
    S = tokens_BS.shape[1]
    pos = position_ids_from_lengths(lengths_B, S)
    plain = position_ids_from_lengths(lengths_B, S, zero_past_length=False)
    assert pos.dtype == plain.dtype == torch.int64
    assert torch.equal(plain, torch.arange(S).expand(len(lengths_B), S))
    mask = mask_from_lengths(lengths_B, S)
    assert torch.equal(pos[mask], plain[mask])
    assert (pos[~mask] == 0).all()


def test_lengths_above_width_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\].*max 4.*widen"):
        right_to_left_pad(torch.zeros(2, 3), torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="integers.*float"):
        mask_from_lengths(torch.tensor([1.0]), 3)

"""Which tokens count: one rule for the loss normalizers, the -inf check and the reward read-out.

A token of row ``b`` at position ``s`` counts when ``s < lengths_B[b]`` (right padding), its
``token_mask`` entry is nonzero and its row's ``sample_mask`` is nonzero. The worker computes
the per-token mask, the global valid-token count and the last real token from these functions
only, so the three always agree.

Shape legend: ``B`` batch, ``S`` sequence.
"""

import torch

from policyworker.functional.padding import mask_from_lengths

__all__ = ["counted_tokens", "last_token_values", "mask_within_lengths", "valid_token_total"]


def mask_within_lengths(token_mask_BS: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """``token_mask_BS`` with zeros at padding positions (``s >= lengths_B[b]``), dtype kept."""
    in_len_BS = mask_from_lengths(lengths_B.to(torch.int64), token_mask_BS.shape[1])
    in_len_BS = in_len_BS.to(token_mask_BS.device)
    return torch.where(in_len_BS, token_mask_BS, torch.zeros_like(token_mask_BS))


def counted_tokens(
    lengths_B: torch.Tensor,
    seq_len: int,
    token_mask_BS: torch.Tensor | None,
    sample_mask_B: torch.Tensor | None,
) -> torch.Tensor:
    """bool [B, seq_len]: the tokens that count (inside the length, token and sample masks)."""
    valid_BS = mask_from_lengths(lengths_B.to(torch.int64), seq_len).to(lengths_B.device)
    if token_mask_BS is not None:
        valid_BS = valid_BS & (token_mask_BS.to(valid_BS.device) != 0)
    if sample_mask_B is not None:
        valid_BS = valid_BS & (sample_mask_B.to(valid_BS.device) != 0)[:, None]
    return valid_BS


def valid_token_total(
    seq_len: int, token_mask_BS: torch.Tensor | None, sample_mask_B: torch.Tensor
) -> torch.Tensor:
    """fp32 scalar: the loss's token normalizer of one rank's batch.

    With a token mask (already cut to the lengths by `mask_within_lengths`): the sum of its
    next-token columns ``[:, 1:]`` weighted by the sample mask. Without one (sequence-level
    losses): ``seq_len`` tokens per counted sample, as NeMo-RL counts them.
    """
    sample_B = sample_mask_B.to(torch.float32)
    if token_mask_BS is None:
        return sample_B.sum() * seq_len
    return (
        token_mask_BS[:, 1:].to(torch.float32) * sample_B[:, None].to(token_mask_BS.device)
    ).sum()


def last_token_values(values_BS: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """[B]: ``values_BS[b, lengths_B[b] - 1]``, and 0 for rows of length 0."""
    lengths_B = lengths_B.to(torch.int64).to(values_BS.device)
    last_B = (lengths_B - 1).clamp(min=0)
    picked_B = values_BS.gather(1, last_B[:, None])[:, 0]
    return torch.where(lengths_B > 0, picked_B, torch.zeros_like(picked_B))

"""Masks, lengths, position ids and right <-> left padding of token batches.

Shape legend: ``B`` batch, ``S`` sequence. A *right-padded* row holds its ``len_b`` real tokens
at positions ``[0, len_b)``; a *left-padded* row holds them at ``[S - len_b, S)``.

All functions are pure: they never modify their arguments and read no runtime state.
"""

import torch

__all__ = [
    "left_to_right_pad",
    "lengths_from_mask",
    "mask_from_lengths",
    "position_ids_from_lengths",
    "right_to_left_pad",
]


def _check_lengths(lengths_B: torch.Tensor, seq_len: int, *, what: str = "lengths_B") -> None:
    if lengths_B.ndim != 1:
        raise ValueError(
            f"{what} must be 1-D [B], got shape {tuple(lengths_B.shape)}; pass one length per row"
        )
    if lengths_B.dtype.is_floating_point or lengths_B.dtype == torch.bool:
        raise ValueError(
            f"{what} must hold integers, got dtype {lengths_B.dtype}; cast with .long()"
        )
    if lengths_B.numel() and (int(lengths_B.min()) < 0 or int(lengths_B.max()) > seq_len):
        raise ValueError(
            f"{what} must lie in [0, {seq_len}] (the sequence width), got min "
            f"{int(lengths_B.min())} and max {int(lengths_B.max())}; fix the lengths or widen "
            "the batch"
        )


def mask_from_lengths(lengths_B: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Right-padding mask: ``mask_BS[b, s] = s < lengths_B[b]`` (bool [B, S]).

    Raises:
        ValueError: lengths not 1-D integers in ``[0, seq_len]``.
    """
    _check_lengths(lengths_B, seq_len)
    positions_S = torch.arange(seq_len, device=lengths_B.device)
    return positions_S[None, :] < lengths_B[:, None]


def lengths_from_mask(mask_BS: torch.Tensor) -> torch.Tensor:
    """Number of true entries per row (int64 [B]); the inverse of :func:`mask_from_lengths`."""
    if mask_BS.ndim != 2:
        raise ValueError(f"mask_BS must be 2-D [B, S], got shape {tuple(mask_BS.shape)}")
    return mask_BS.to(torch.bool).sum(dim=1, dtype=torch.int64)


def position_ids_from_lengths(
    lengths_B: torch.Tensor, seq_len: int, *, zero_past_length: bool = True
) -> torch.Tensor:
    """Position ids (int64 [B, S]): ``0 .. S-1`` per row, and 0 at ``s >= len_b`` by default.

    With ``zero_past_length=False`` every row is the plain ``arange(S)`` (the reference worker's
    non-packed convention: pads sit after the real tokens, so their positions never matter).
    """
    _check_lengths(lengths_B, seq_len)
    positions_S = torch.arange(seq_len, device=lengths_B.device)
    positions_BS = positions_S.expand(lengths_B.shape[0], seq_len)
    if not zero_past_length:
        return positions_BS.clone()
    inside_BS = positions_BS < lengths_B[:, None]
    return torch.where(inside_BS, positions_BS, torch.zeros_like(positions_BS))


def _shift_rows(
    x_BS: torch.Tensor, shift_B: torch.Tensor, keep_BS: torch.Tensor, pad_value: float | int
) -> torch.Tensor:
    """Row b's element at s moves to ``(s + shift_B[b]) mod S``; entries not kept become pad."""
    S = x_BS.shape[1]
    source_BS = (torch.arange(S, device=x_BS.device)[None, :] - shift_B[:, None]) % S
    index = source_BS.reshape(*source_BS.shape, *([1] * (x_BS.ndim - 2))).expand_as(x_BS)
    moved = torch.gather(x_BS, 1, index)
    keep = keep_BS.reshape(*keep_BS.shape, *([1] * (x_BS.ndim - 2)))
    return torch.where(keep, moved, torch.full_like(moved, pad_value))


def right_to_left_pad(
    x_BS: torch.Tensor, lengths_B: torch.Tensor, pad_value: float | int = 0
) -> torch.Tensor:
    """Move each row's first ``len_b`` entries to the end of the row; pad the front.

    Works on ``[B, S]`` and ``[B, S, ...]``; returns a new tensor.

    Example (``S = 4``, pad ``-1``): ``[[5, 6, -1, -1]]`` with ``lengths [2]`` ->
    ``[[-1, -1, 5, 6]]``.
    """
    if x_BS.ndim < 2:
        raise ValueError(f"x_BS must be at least 2-D [B, S, ...], got shape {tuple(x_BS.shape)}")
    S = x_BS.shape[1]
    _check_lengths(lengths_B, S)
    lengths_B = lengths_B.to(x_BS.device)
    keep_BS = torch.arange(S, device=x_BS.device)[None, :] >= (S - lengths_B)[:, None]
    return _shift_rows(x_BS, S - lengths_B, keep_BS, pad_value)


def left_to_right_pad(
    x_BS: torch.Tensor, lengths_B: torch.Tensor, pad_value: float | int = 0
) -> torch.Tensor:
    """Move each row's last ``len_b`` entries to the front of the row; pad the end.

    The inverse of :func:`right_to_left_pad` on the real tokens.
    """
    if x_BS.ndim < 2:
        raise ValueError(f"x_BS must be at least 2-D [B, S, ...], got shape {tuple(x_BS.shape)}")
    S = x_BS.shape[1]
    _check_lengths(lengths_B, S)
    lengths_B = lengths_B.to(x_BS.device)
    keep_BS = torch.arange(S, device=x_BS.device)[None, :] < lengths_B[:, None]
    return _shift_rows(x_BS, lengths_B - S, keep_BS, pad_value)

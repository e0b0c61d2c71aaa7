"""Checks of the batch's token ids, lengths and batch-size arguments, each raising `DataError`
(a `ValueError`) naming the key, the offending value and position, the rule and the fix.

Shape legend: ``B`` rows, ``S`` padded sequence length. All functions are pure.
"""

from __future__ import annotations

from typing import Any

import torch

from policyworker.errors import DataError

__all__ = [
    "batch_size_argument",
    "first_nonfinite",
    "first_out_of_range",
    "require_nonempty_rows",
    "require_token_ids_in_vocab",
    "token_ids_as_int64",
]


def first_out_of_range(
    values: torch.Tensor, low: int, high: int
) -> tuple[tuple[int, ...], int] | None:
    """(index, value) of the first entry outside ``[low, high)`` in row-major order, else None.

    ``values`` is an int64 tensor (see `token_ids_as_int64`): comparing a narrower integer
    tensor with ``high`` would wrap ``high`` into its dtype.
    """
    outside = (values < low) | (values >= high)
    if not bool(outside.any()):
        return None
    index = tuple(int(i) for i in outside.nonzero()[0])
    return index, int(values[index])


def first_nonfinite(values: torch.Tensor, where: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first non-finite entry of ``values`` where ``where`` is true, else None."""
    bad = ~torch.isfinite(values) & where
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def token_ids_as_int64(key: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` cast exactly to int64: any integer dtype is accepted, every other is refused.

    uint64 entries of 2**63 or more become negative, so a range check of the result refuses
    them; `require_token_ids_in_vocab` then reports the caller's own value.

    Raises:
        DataError: ``values`` is bool, floating point or complex.
    """
    dtype = values.dtype
    if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise DataError(
            f"{key!r} must hold integer token ids, got dtype {dtype} with shape "
            f"{tuple(values.shape)}; any integer dtype works (int8 .. int64, uint8 .. uint64): "
            f"cast with .long()"
        )
    return values if dtype == torch.int64 else values.to(torch.int64)


def require_token_ids_in_vocab(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``input_ids`` as int64 after checking every id, padding included (the model embeds padding
    too), is in ``[0, vocab_size)``.

    Raises:
        DataError: a non-integer dtype, or an id outside the vocabulary (named with its row,
            column and the value the caller passed).
    """
    ids_BS = token_ids_as_int64("input_ids", input_ids)
    found = first_out_of_range(ids_BS, 0, vocab_size)
    if found is not None:
        (row, col), _ = found
        value = int(input_ids[row, col].item())  # the caller's value (a uint64 stays unsigned)
        raise DataError(
            f"'input_ids'[{row}, {col}] = {value} is outside the model's vocabulary "
            f"[0, {vocab_size}); every position is embedded, padding included: pad with a real "
            f"token id (e.g. 0) and check the tokenizer matches the model"
        )
    return ids_BS


def require_nonempty_rows(input_lengths: torch.Tensor) -> None:
    """Training rows hold at least one token (a row of length 0 has nothing to learn from)."""
    empty = (input_lengths < 1).nonzero()
    if empty.numel():
        rows = [int(r) for r in empty[:8, 0]]
        raise DataError(
            f"'input_lengths' is 0 at row(s) {rows} ({empty.shape[0]} of "
            f"{input_lengths.shape[0]}); a training row needs at least 1 token: drop those "
            f"rows, or give them length >= 1 and sample_mask 0"
        )


def batch_size_argument(name: str, value: Any, default: int) -> int:
    """``value`` as a positive int (None -> ``default``); bools, floats and strings are refused."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(
            f"train({name}={value!r}) must be a positive int (or None for the "
            f"config's value {default}); pass e.g. {name}={default}"
        )
    return value

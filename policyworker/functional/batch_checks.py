"""Checks a training or inference batch must pass before any of it reaches the model.

Each function looks at tensors and plain numbers only and either returns quietly, returns a
normalised value, or raises `DataError` naming the key, the offending value and position, the
rule and the fix. The worker runs them on *every* global batch before the first optimizer step,
so a bad second batch can no longer fail after the first batch's step was applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from policyworker.errors import DataError

__all__ = [
    "LOSS_FLOAT_INPUTS",
    "batch_size_argument",
    "cast_loss_inputs",
    "counted_positions",
    "first_nonfinite",
    "first_out_of_range",
    "nonfinite_loss_input",
    "require_nonempty_rows",
    "require_token_ids_in_vocab",
]

# Float inputs NeMo-RL's losses read (per row [B] or per token [B, S]).
LOSS_FLOAT_INPUTS = (
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
    "reference_policy_logprobs",
    "token_mask",
    "sample_mask",
)


def first_out_of_range(
    values: torch.Tensor, low: int, high: int
) -> tuple[tuple[int, ...], int] | None:
    """(index, value) of the first entry outside ``[low, high)`` in row-major order, else None."""
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


def require_token_ids_in_vocab(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Every id, padding included (the model embeds padding too), is in ``[0, vocab_size)``."""
    found = first_out_of_range(input_ids, 0, vocab_size)
    if found is not None:
        (row, col), value = found
        raise DataError(
            f"'input_ids'[{row}, {col}] = {value} is outside the model's vocabulary "
            f"[0, {vocab_size}); every position is embedded, padding included: pad with a real "
            f"token id (e.g. 0) and check the tokenizer matches the model"
        )


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


def cast_loss_inputs(data: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy whose loss inputs are float32 where they were integer or bool.

    int64 advantages and bool masks are ordinary ways to build a batch; casting them is exact.
    Complex values have no meaning here and are refused.
    """
    out = dict(data)
    for key in LOSS_FLOAT_INPUTS:
        value = data.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if value.dtype.is_complex:
            raise DataError(
                f"{key!r} has complex dtype {value.dtype}; the loss needs real "
                f"numbers: pass a float tensor (e.g. value.real.float())"
            )
        if not value.dtype.is_floating_point:
            out[key] = value.to(torch.float32)
    return out


def counted_positions(data: Mapping[str, Any]) -> torch.Tensor:
    """[B, S] bool: the positions a token-level loss reads (columns 1.. within length, kept by
    ``token_mask`` and ``sample_mask``); column 0 has no next-token prediction."""
    ids = data["input_ids"]
    seq_len = ids.shape[1]
    columns = torch.arange(seq_len, device=ids.device)[None]
    counted = (columns >= 1) & (columns < data["input_lengths"].to(ids.device)[:, None])
    if isinstance(data.get("token_mask"), torch.Tensor):
        counted = counted & (data["token_mask"].to(ids.device) != 0)
    if isinstance(data.get("sample_mask"), torch.Tensor):
        counted = counted & (data["sample_mask"].to(ids.device) != 0)[:, None]
    return counted


def nonfinite_loss_input(data: Mapping[str, Any]) -> str | None:
    """Why the loss inputs cannot be trusted, or None: masks must be finite everywhere, the
    other inputs wherever the loss reads them (NaN in a masked-out token is harmless)."""
    counted = counted_positions(data)
    counted_rows = counted.any(dim=1)
    for key in LOSS_FLOAT_INPUTS:
        value = data.get(key)
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            continue
        if key in ("token_mask", "sample_mask"):
            where = torch.ones_like(value, dtype=torch.bool)
        elif value.ndim >= 2:
            where = counted.to(value.device).reshape(counted.shape + (1,) * (value.ndim - 2))
            where = where.expand_as(value)
        else:
            where = counted_rows.to(value.device)
        found = first_nonfinite(value, where)
        if found is not None:
            return (
                f"{key!r}{list(found)} = {float(value[found])} is not finite at a position "
                f"the loss reads; fix the producer of {key!r} or mask that token/row out"
            )
    return None


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

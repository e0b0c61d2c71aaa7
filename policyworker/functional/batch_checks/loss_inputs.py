"""The loss inputs of a training batch: their dtypes, per-sequence advantages, and which values
the loss reads must be finite.

Shape legend: ``B`` rows, ``S`` padded sequence length. All functions are pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from policyworker.errors import DataError
from policyworker.functional.batch_checks.shapes import first_nonfinite

__all__ = [
    "LOSS_FLOAT_INPUTS",
    "PER_TOKEN_LOSS_INPUTS",
    "cast_loss_inputs",
    "counted_positions",
    "nonfinite_loss_input",
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
# The loss inputs that hold one value per token ([B, S]); `advantages` may also be [B].
PER_TOKEN_LOSS_INPUTS = (
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
    "reference_policy_logprobs",
    "token_mask",
)


def cast_loss_inputs(data: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy whose loss inputs are float32 where they were integer or bool, and whose
    per-sequence ``advantages`` [B] are broadcast over the row's positions ([B, S]).

    int64 advantages and bool masks are ordinary ways to build a batch; casting them is exact.
    One advantage per row (TRL's and verl's shape) means the same advantage at every token of
    the row; ``token_mask`` still decides which tokens count. Complex values have no meaning
    here and are refused, and so is a [B] tensor for any other per-token input.
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
            out[key] = value = value.to(torch.float32)
        if key in PER_TOKEN_LOSS_INPUTS and value.ndim == 1:
            out[key] = _per_token(key, value, data.get("input_ids"))
    return out


def _per_token(key: str, value_B: torch.Tensor, ids: Any) -> torch.Tensor:
    if key != "advantages" or not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise DataError(
            f"{key!r} has shape {tuple(value_B.shape)}, but it holds one value per token: "
            f"pass a [B, S] tensor shaped like 'input_ids' (only 'advantages' may be "
            f"per-sequence [B], broadcast over the row's tokens)"
        )
    return value_B[:, None].expand(ids.shape).contiguous()


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

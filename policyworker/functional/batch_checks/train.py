"""The one check of a ``train()`` batch: `check_train_batch` returns a `TrainBatch`, the data the
training loop reads (token ids int64, loss inputs float32, per-sequence advantages broadcast),
or raises `DataError` / `ValueError` before anything runs.

Shape legend: ``B`` rows on this rank, ``S`` padded sequence length. All functions are pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from policyworker.errors import DataError
from policyworker.functional.batch_checks.loss_inputs import cast_loss_inputs, nonfinite_loss_input
from policyworker.functional.batch_checks.shapes import (
    batch_size_argument,
    require_nonempty_rows,
    require_token_ids_in_vocab,
)
from policyworker.functional.data_checks import check_loss_fn, train_required_keys, validate_batch
from policyworker.functional.staleness import check_generation_versions

__all__ = ["TrainBatch", "check_batch", "check_train_batch"]


@attrs.frozen(kw_only=True)
class TrainBatch:
    """A checked training batch and the batch sizes to train it with.

    ``untrusted[g]`` says why local global batch ``g`` (rows ``g * gbs // dp_size`` onwards)
    has a non-finite value where its loss reads, or is None; such a batch is not stepped.
    """

    data: dict[str, Any]
    gbs: int
    mbs: int
    untrusted: tuple[str | None, ...]

    def reason_untrusted(self, g: int) -> str | None:
        """Why global batch ``g`` cannot be trusted, or None (a rank without rows: None)."""
        return self.untrusted[g] if g < len(self.untrusted) else None


def check_batch(
    data: Mapping[str, Any],
    *,
    vocab_size: int,
    required: Sequence[str] = ("input_ids", "input_lengths"),
    skip: Sequence[str] = (),
    needed_by: str = "",
) -> dict[str, Any]:
    """A shallow copy of a checked batch (keys, shapes, masks, token ids in the vocabulary) with
    ``input_ids`` and ``input_lengths`` cast exactly to int64; what every batch call reads."""
    validate_batch(data, required=required, check_dim_skip_keys=tuple(skip), needed_by=needed_by)
    for key in ("token_mask", "sample_mask"):
        if key in data and not isinstance(data[key], torch.Tensor):
            raise DataError(
                f"data[{key!r}] must be a tensor, got {type(data[key]).__name__}; pass a "
                f"float or bool tensor ({'[B, S]' if key == 'token_mask' else '[B]'})"
            )
    out = dict(data)
    if isinstance(data.get("input_ids"), torch.Tensor):
        out["input_ids"] = require_token_ids_in_vocab(data["input_ids"], vocab_size)
    if isinstance(data.get("input_lengths"), torch.Tensor):
        out["input_lengths"] = data["input_lengths"].to(torch.int64)
    return out


def check_train_batch(
    data: Mapping[str, Any],
    loss_fn: Any,
    *,
    vocab_size: int,
    dp_size: int,
    gbs: Any,
    mbs: Any,
    default_gbs: int,
    default_mbs: int,
    skip: Sequence[str] = (),
) -> TrainBatch:
    """Check everything ``train(data, loss_fn, gbs=, mbs=)`` reads, once, before any work.

    The loss object, the keys the loss needs, shapes and dtypes, token ids in
    ``[0, vocab_size)``, no empty row, per-token ``generation_versions`` (when given), the
    batch sizes (``gbs`` a multiple of ``dp_size``) and
    the loss inputs (complex refused, per-sequence ``advantages`` broadcast; non-finite values
    are not refused but recorded per global batch in ``TrainBatch.untrusted``).

    Raises:
        DataError: the batch (a ``ValueError`` naming key, value, rule and fix).
        ValueError: the loss object or the batch sizes.
    """
    check_loss_fn(loss_fn)
    checked = check_batch(
        data,
        vocab_size=vocab_size,
        required=train_required_keys(loss_fn),
        skip=skip,
        needed_by=f"train() with {type(loss_fn).__name__}",
    )
    require_nonempty_rows(checked["input_lengths"])
    check_generation_versions(checked)
    gbs = batch_size_argument("gbs", gbs, default_gbs)
    mbs = batch_size_argument("mbs", mbs, default_mbs)
    if gbs % dp_size != 0:
        raise DataError(
            f"train(gbs={gbs}) must be a multiple of the data-parallel size {dp_size}; pass "
            f"gbs={max(dp_size, gbs - gbs % dp_size)} or another multiple of {dp_size}"
        )
    checked = cast_loss_inputs(checked)
    local_gbs = gbs // dp_size
    rows = checked["input_ids"].shape[0]
    untrusted = tuple(
        nonfinite_loss_input({k: _rows(v, start, local_gbs) for k, v in checked.items()})
        for start in range(0, rows, local_gbs)
    )
    return TrainBatch(data=checked, gbs=gbs, mbs=mbs, untrusted=untrusted)


def _rows(value: Any, start: int, count: int) -> Any:
    return value[start : start + count]

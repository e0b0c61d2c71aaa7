"""Every dp rank's shard checked on the driver, by the worker's own batch checks, before any rank
starts: a bad row in one shard must not reach one rank while its peers enter a collective.

The checks are the worker's (`policyworker.data` / `functional.batch_checks`), called with what
the driver knows: the shards and the model's vocabulary rows (asked of rank 0 once, at start).
The workers still check their shard themselves, and agree across ranks before any collective
(`shell.parallel.agreed_checks`); this is the early, cheap refusal that names the caller's rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.data import check_loss_fn, train_required_keys, validate_batch
from policyworker.errors import DataError
from policyworker.functional import batch_checks

__all__ = ["check_shards"]

_ROWS_SHOWN = 8


def check_shards(
    method: str,
    shards: Sequence[Mapping[str, Any]],
    rows: Sequence[torch.Tensor],
    *,
    vocab_rows: int,
    loss_fn: Any = None,
    skip: Sequence[str] = (),
) -> None:
    """Refuse the call when any shard fails the worker's batch checks: `train` (with `loss_fn`)
    checks what `PolicyWorker.train` does, other methods what `get_logprobs` does. The error
    names the dp rank, the caller's rows in its shard and the worker check's own message."""
    training = method == "train"
    if training:
        check_loss_fn(loss_fn)
    for dp_rank, (shard, shard_rows) in enumerate(zip(shards, rows, strict=True)):
        try:
            _check_one(shard, training=training, loss_fn=loss_fn, skip=skip, vocab=vocab_rows)
        except ValueError as err:
            shown = [int(r) for r in shard_rows[:_ROWS_SHOWN]]
            more = ", ..." if len(shard_rows) > _ROWS_SHOWN else ""
            msg = (
                f"{method}: the shard of data-parallel rank {dp_rank} (rows "
                f"{str(shown)[1:-1]}{more} of data, in this order) is refused before any rank "
                f"starts: {err}"
            )
            raise DataError(msg) from err


def _check_one(
    shard: Mapping[str, Any], *, training: bool, loss_fn: Any, skip: Sequence[str], vocab: int
) -> None:
    if training:
        validate_batch(
            shard,
            required=train_required_keys(loss_fn),
            check_dim_skip_keys=tuple(skip),
            needed_by=f"train() with {type(loss_fn).__name__}",
        )
    else:
        validate_batch(shard)
    if isinstance(shard.get("input_ids"), torch.Tensor):
        batch_checks.require_token_ids_in_vocab(shard["input_ids"], vocab)
    if training:
        batch_checks.require_nonempty_rows(shard["input_lengths"])

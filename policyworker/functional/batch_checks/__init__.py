"""Checks a batch must pass before any of it reaches the model, in one place.

Each function looks at tensors and plain numbers only and either returns a normalised value or
raises `DataError` (a ``ValueError``) naming the key, the offending value and position, the rule
and the fix. ``train()`` calls `check_train_batch` once; the inference calls call `check_batch`.

    shapes.py       token ids (any integer dtype, in the vocabulary), lengths, batch sizes
    loss_inputs.py  loss-input dtypes, per-sequence advantages, non-finite values the loss reads
    train.py        check_train_batch -> TrainBatch; check_batch for the other calls

The names below are re-exported for callers that import the package.
"""

from policyworker.functional.batch_checks.loss_inputs import (
    LOSS_FLOAT_INPUTS,
    PER_TOKEN_LOSS_INPUTS,
    cast_loss_inputs,
    counted_positions,
    nonfinite_loss_input,
)
from policyworker.functional.batch_checks.shapes import (
    batch_size_argument,
    first_nonfinite,
    first_out_of_range,
    require_nonempty_rows,
    require_token_ids_in_vocab,
    token_ids_as_int64,
)
from policyworker.functional.batch_checks.train import TrainBatch, check_batch, check_train_batch

__all__ = [
    "LOSS_FLOAT_INPUTS",
    "PER_TOKEN_LOSS_INPUTS",
    "TrainBatch",
    "batch_size_argument",
    "cast_loss_inputs",
    "check_batch",
    "check_train_batch",
    "counted_positions",
    "first_nonfinite",
    "first_out_of_range",
    "nonfinite_loss_input",
    "require_nonempty_rows",
    "require_token_ids_in_vocab",
    "token_ids_as_int64",
]

# pyright: basic
"""Checks at the edge of a train or inference call: the batch, and the loss object.

``validate_batch`` raises ``DataError`` naming the key, the shapes and the fix before a batch
reaches the model; ``check_loss_fn`` and ``train_required_keys`` say what ``train`` needs of its
loss. ``batch_rows`` (the dim-0 length a value must share) is the one rule ``BatchedDataDict``
shares with them.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.errors import DataError
from policyworker.functional.loss_protocol import LossType, input_type_of, loss_type_of

__all__ = ["batch_rows", "check_loss_fn", "train_required_keys", "validate_batch"]


def batch_rows(value: Any, key: str) -> int:
    """Rows (dim 0) of a batch value: a tensor with a batch dim, or a list / tuple."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise DataError(
                f"key {key!r} holds a 0-d tensor, which has no batch dim; store "
                "per-row values as a [B] tensor"
            )
        return value.shape[0]
    if isinstance(value, list | tuple):
        return len(value)
    raise DataError(
        f"key {key!r} holds a {type(value).__name__}; values must be tensors or lists "
        "with one entry per row"
    )


def validate_batch(
    data: Mapping[str, Any],
    *,
    required: Sequence[str] = ("input_ids", "input_lengths"),
    check_dim_skip_keys: Sequence[str] = (),
    needed_by: str = "",
) -> None:
    """Check a batch before it reaches the model; raise ``DataError`` naming key, shapes and fix.

    Checks: required keys present (every missing one in one message; ``needed_by`` says who
    reads them); ``input_ids`` a 2-D integer tensor; ``input_lengths`` a 1-D integer tensor with
    values in ``[0, S]``; ``sample_mask`` (when present) a [B] tensor; every value has the same
    batch size; every tensor with ndim >= 2 (except ``check_dim_skip_keys``) has dim 1 == S.
    """
    missing = [k for k in dict.fromkeys(required) if k not in data]
    if missing:
        who = f" ({needed_by} reads them)" if needed_by else ""
        raise DataError(
            f"batch is missing {len(missing)} required key(s) {missing}{who}; it has "
            f"{sorted(data)}; add every missing key (per-token tensors are [B, S], per-row [B])"
        )
    _validate_sample_mask(data.get("sample_mask"))
    ids = data.get("input_ids")
    if ids is not None:
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise DataError(
                f"'input_ids' must be a [B, S] tensor, got {shape}; pass right-padded ids"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise DataError(
                f"'input_ids' must hold integer token ids, got dtype {ids.dtype} with "
                f"shape {tuple(ids.shape)}; any integer dtype works: cast with .long()"
            )
        if ids.shape[1] == 0:
            raise DataError(
                f"'input_ids' has shape {tuple(ids.shape)}: no token positions (S = 0); every "
                f"row needs at least one token column: pass right-padded ids [B, S] with S >= 1"
            )
    lengths = data.get("input_lengths")
    if lengths is not None:
        _validate_lengths_type(lengths)
    batch = {k: batch_rows(v, k) for k, v in data.items()}
    sizes = {
        k: (tuple(v.shape) if isinstance(v, torch.Tensor) else len(v)) for k, v in data.items()
    }
    if len(set(batch.values())) > 1:
        raise DataError(
            f"batch sizes disagree across keys (dim 0): {sizes}; every value needs the "
            "same number of rows"
        )
    if ids is not None:
        S = ids.shape[1]
        bad = {
            k: s
            for k, s in sizes.items()
            if isinstance(data[k], torch.Tensor)
            and data[k].ndim >= 2
            and k not in check_dim_skip_keys
            and data[k].shape[1] != S
        }
        if bad:
            raise DataError(
                f"sequence dim (dim 1) of {bad} disagrees with 'input_ids' "
                f"{tuple(ids.shape)}; pad/truncate them to S or list them in "
                "check_dim_skip_keys"
            )
        if lengths is not None:
            _validate_lengths_range(lengths, ids)


def _validate_sample_mask(mask: Any) -> None:
    if isinstance(mask, torch.Tensor) and mask.ndim != 1:
        raise DataError(
            f"'sample_mask' has shape {tuple(mask.shape)}, but it must be [B]: one 0/1 per row "
            f"(0 drops the whole row). Per-token masking belongs in 'token_mask' [B, S]; for a "
            f"[B, S] mask pass it as token_mask, or sample_mask=mask.amax(dim=1)"
        )


def check_loss_fn(loss_fn: Any) -> None:
    """Raise ``ValueError`` unless ``loss_fn`` is a loss *instance* (the LossFunction protocol:
    callable, with ``loss_type`` and ``input_type``)."""
    if loss_fn is None:
        msg = (
            "train(data, loss_fn): loss_fn is None; pass a loss instance, e.g. "
            "ClippedPGLossFn({'reference_policy_kl_penalty': 0.01}), NLLLoss() or "
            "DPOLossFn({...}) from policyworker.functional.loss"
        )
        raise ValueError(msg)
    if isinstance(loss_fn, type):
        msg = (
            f"train(data, loss_fn): loss_fn is the class {loss_fn.__name__}, not an instance; "
            f"pass {loss_fn.__name__}(...) (e.g. {loss_fn.__name__}() or "
            f"{loss_fn.__name__}(cfg) with NeMo-RL's loss_fn mapping)"
        )
        raise ValueError(msg)
    lacking = [a for a in ("loss_type", "input_type") if not hasattr(loss_fn, a)]
    if lacking or not callable(loss_fn):
        what = f"has no {' or '.join(lacking)}" if lacking else "is not callable"
        msg = (
            f"train(data, loss_fn): loss_fn {type(loss_fn).__name__!r} {what}; a loss is "
            f"callable as loss_fn(data, global_valid_seqs, global_valid_toks, **inputs) and "
            f"has loss_type (LossType) and input_type (LossInputType) attributes"
        )
        raise ValueError(msg)
    loss_type_of(loss_fn)  # each read by its value, so another library's enum of them counts
    input_type_of(loss_fn)


def train_required_keys(loss_fn: Any) -> tuple[str, ...]:
    """The batch keys ``train(data, loss_fn)`` needs: the worker's, then the loss's own
    (``loss_fn.required_keys`` when the loss declares them)."""
    keys = ["input_ids", "input_lengths", "sample_mask"]
    kind = getattr(loss_fn, "loss_type", "")
    if getattr(kind, "value", kind) == LossType.TOKEN_LEVEL.value:  # any enum of that value
        keys.append("token_mask")
    keys += list(getattr(loss_fn, "required_keys", ()))
    return tuple(dict.fromkeys(keys))


def _validate_lengths_type(lengths: Any) -> None:
    if not isinstance(lengths, torch.Tensor) or lengths.ndim != 1:
        shape = (
            tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        )
        raise DataError(
            f"'input_lengths' must be a [B] tensor, got {shape}; pass one length per row"
        )
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise DataError(
            f"'input_lengths' must hold integers, got dtype {lengths.dtype}; cast with .long()"
        )


def _validate_lengths_range(lengths: torch.Tensor, ids: torch.Tensor) -> None:
    S = ids.shape[1]
    # int64 first: a narrower dtype would wrap S, and uint64 has no comparison; uint64 values of
    # 2**63 or more turn negative and are refused with the caller's value below.
    lengths64 = lengths.to(torch.int64)
    outside = (lengths64 > S) | (lengths64 < 0)
    if bool(outside.any()):
        row = int(outside.nonzero()[0, 0])
        raise DataError(
            f"'input_lengths'[{row}] = {lengths[row].tolist()} is outside [0, S={S}] of "
            f"'input_ids' {tuple(ids.shape)}; fix the lengths or pad input_ids wider"
        )

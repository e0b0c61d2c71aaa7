"""Tinker `Datum` lists as the worker's batch (docs/batch-format.md), and Tinker's loss names as
the worker's losses.

A datum's N positions become a row of N + 1 tokens: ``model_input`` then the last target token.
Position i of every ``loss_fn_inputs`` tensor (the target of position i) lands in column i + 1,
the column of the token it predicts, where the worker's masks, advantages and logprobs live.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.functional.loss import NLLLoss
from policyworker.functional.pg_loss import ClippedPGLossFn
from policyworker.training_client.types import Datum, as_tensor

__all__ = ["LOSS_NAMES", "loss_for", "rl_inputs_missing", "to_batch"]

LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
_RL_INPUTS = ("logprobs", "advantages")
_NO_CLIP = 1e9  # a ratio clip no ratio reaches: plain importance sampling


def loss_for(loss_fn: Any, loss_fn_config: Mapping[str, float] | None = None) -> Any:
    """The worker loss of a Tinker loss name, or `loss_fn` itself when it is a worker loss
    (an object with ``loss_type`` and ``input_type``, docs/custom-loss.md)."""
    if not isinstance(loss_fn, str):
        return loss_fn
    cfg = dict(loss_fn_config or {})
    low, high = 1 - cfg.pop("clip_low_threshold", 0.8), cfg.pop("clip_high_threshold", 1.2) - 1
    if loss_fn not in LOSS_NAMES or cfg:
        msg = (
            f"loss_fn={loss_fn!r} with loss_fn_config keys {sorted(cfg)}: the names are "
            f"{list(LOSS_NAMES)} and the only config keys clip_low_threshold / "
            "clip_high_threshold (ppo, cispo); pass one of them or a worker loss object"
        )
        raise ValueError(msg)
    if loss_fn == "cross_entropy":
        return NLLLoss()
    pg = {"reference_policy_kl_penalty": 0.0, "kl_input_clamp_value": None}
    if loss_fn == "importance_sampling":
        pg.update(ratio_clip_min=_NO_CLIP, ratio_clip_max=_NO_CLIP)
    else:
        pg.update(ratio_clip_min=low, ratio_clip_max=high, use_cispo=loss_fn == "cispo")
    return ClippedPGLossFn(pg)


def _row(datum: Datum, i: int) -> dict[str, torch.Tensor]:
    tokens = as_tensor(datum.model_input.tokens, dtype=torch.int64)
    inputs = {k: v for k, v in datum.loss_fn_inputs.items()}
    if "target_tokens" not in inputs:
        msg = (
            f"data[{i}].loss_fn_inputs has no 'target_tokens'; add the next token of each position"
        )
        raise ValueError(msg)
    targets = as_tensor(inputs.pop("target_tokens"), dtype=torch.int64)
    n = tokens.numel()
    if n == 0 or targets.numel() != n or not torch.equal(targets[:-1], tokens[1:]):
        msg = (
            f"data[{i}]: target_tokens ({targets.numel()}) must be model_input ({n} tokens) "
            "shifted by one (target i = token i + 1) and as long; build the datum from one "
            "token sequence: model_input = seq[:-1], target_tokens = seq[1:]"
        )
        raise ValueError(msg)
    row = {"input_ids": torch.cat([tokens, targets[-1:]])}
    for key, value in inputs.items():
        values = as_tensor(value, dtype=torch.float32)
        if values.numel() != n:
            msg = f"data[{i}].loss_fn_inputs[{key!r}] has {values.numel()} values, not {n}"
            raise ValueError(msg)
        row[key] = torch.cat([values.new_zeros(1), values])
    return row


def to_batch(data: Sequence[Datum]) -> dict[str, torch.Tensor]:
    """The worker batch of `data`: right-padded ``input_ids``, ``input_lengths``,
    ``sample_mask``, ``token_mask`` (the weights; all targets when absent) and, when the datums
    carry them, ``advantages`` and ``prev_logprobs`` / ``generation_logprobs`` /
    ``reference_policy_logprobs`` (the sampler's logprobs)."""
    if not data:
        msg = "data is empty; pass at least one Datum"
        raise ValueError(msg)
    rows = [_row(d, i) for i, d in enumerate(data)]
    keys = set(rows[0])
    if any(set(r) != keys for r in rows):
        msg = "every datum must carry the same loss_fn_inputs keys"
        raise ValueError(msg)
    lengths = torch.tensor([r["input_ids"].numel() for r in rows])
    width = int(lengths.max())

    def padded(key: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=dtype)
        for b, r in enumerate(rows):
            out[b, : r[key].numel()] = r[key]
        return out

    batch = {
        "input_ids": padded("input_ids", torch.int64),
        "input_lengths": lengths,
        "sample_mask": torch.ones(len(rows)),
    }
    if "weights" in keys:
        batch["token_mask"] = padded("weights", torch.float32)
    else:
        batch["token_mask"] = (torch.arange(width)[None] < lengths[:, None]).float()
        batch["token_mask"][:, 0] = 0
    if "advantages" in keys:
        batch["advantages"] = padded("advantages", torch.float32)
    if "logprobs" in keys:
        sampler = padded("logprobs", torch.float32)
        for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
            batch[key] = sampler
    return batch


def rl_inputs_missing(data: Sequence[Datum]) -> list[str]:
    """The RL loss inputs the first datum lacks."""
    return [k for k in _RL_INPUTS if k not in data[0].loss_fn_inputs]

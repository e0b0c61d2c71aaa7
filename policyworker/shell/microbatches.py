"""Microbatches on the device: validate a batch, plan it, cut it, run the model on a piece.

Microbatching (fixed / dynamic / packed) is planned by `policyworker.functional.batching` on what
this rank receives, padded with dummy microbatches up to the most any rank has, so every rank
runs the same number of forwards (FSDP2 and TP collectives stay in lockstep).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from policyworker.data import validate_batch
from policyworker.functional import batch_checks, batching
from policyworker.functional.microbatching import plan_microbatches
from policyworker.functional.packing import pack, packed_position_ids, unpack
from policyworker.shell import model as model_lib
from policyworker.shell.state import WorkerState

__all__ = ["Microbatch", "forward", "hidden_states", "load", "plan", "validate"]


class Microbatch:
    """One microbatch on the device: model inputs plus the data the loss reads ([b, w] tensors)."""

    def __init__(self, data: dict[str, Any], *, packed: bool, is_dummy: bool) -> None:
        self.data = data
        self.packed = packed
        self.is_dummy = is_dummy
        self.lengths = data["input_lengths"].to(torch.int64)
        self.width = data["input_ids"].shape[1]
        if packed:
            ids_N, self.cu_seqlens = pack(data["input_ids"], self.lengths)
            self.input_ids = ids_N[None]
            self.position_ids = packed_position_ids(self.lengths)[None]
            lengths = self.lengths
            self.max_seqlen = int(lengths.max()) if lengths.numel() else 0
        else:
            self.input_ids = data["input_ids"]
            self.position_ids = torch.arange(self.width, device=self.input_ids.device).expand(
                self.input_ids.shape[0], -1
            )
            self.cu_seqlens, self.max_seqlen = None, None

    def unpack_rows(self, x_1N: torch.Tensor) -> torch.Tensor:
        """Packed [1, N, ...] -> [b, w, ...] (identity for unpacked microbatches)."""
        if not self.packed or self.cu_seqlens is None:
            return x_1N
        return unpack(x_1N[0], self.cu_seqlens, seq_len=self.width, pad_value=0)


def validate(
    state: WorkerState,
    data: Mapping[str, Any],
    *,
    required=("input_ids", "input_lengths"),
    skip=(),
    needed_by: str = "",
) -> None:
    """Refuse a batch the worker cannot use (missing keys, shapes, mask types, token ids outside
    the model's vocabulary), before any work; `needed_by` names who reads the required keys."""
    state.require_running("a batch call (train, logprobs, top-k, score)")
    validate_batch(
        data, required=required, check_dim_skip_keys=tuple(skip or ()), needed_by=needed_by
    )
    for key in ("token_mask", "sample_mask"):
        if key in data and not isinstance(data[key], torch.Tensor):
            msg = f"data[{key!r}] must be a tensor, got {type(data[key]).__name__}"
            raise ValueError(msg)
    if isinstance(data.get("input_ids"), torch.Tensor):
        batch_checks.require_token_ids_in_vocab(data["input_ids"], state.vocab_rows)


def plan(
    state: WorkerState,
    lengths: torch.Tensor,
    *,
    seq_len: int,
    mbs: int,
    purpose: Literal["train", "logprob"],
) -> list[batching.MicrobatchPlan]:
    """Fixed / dynamic / packed plans for this rank, plus dummies up to the all-rank max."""
    plans = plan_microbatches(state.cfg, lengths, seq_len=seq_len, mbs=mbs, purpose=purpose)
    max_count = state.parallel.all_reduce_int(len(plans), op="max", axis="world")
    return plans + batching.dummy_microbatches(
        plans, batching.num_dummy_microbatches(len(plans), max_count)
    )


def load(
    state: WorkerState, data: Mapping[str, Any], plan: batching.MicrobatchPlan, *, skip=()
) -> Microbatch:
    """The rows of `plan`, cut to its width (sequence dims not in `skip`), on the device."""
    rows = list(plan.rows)
    lengths = data["input_lengths"][rows]
    width = int(lengths.max()) if plan.packed and rows else plan.width
    width = max(width, 1)
    index = torch.tensor(rows, dtype=torch.int64)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            t = value.index_select(0, index.to(value.device))
            if t.ndim >= 2 and key not in skip:
                t = t[:, :width]
            out[key] = t.to(state.device, non_blocking=True)
        else:
            out[key] = [value[i] for i in rows]
    mb = Microbatch(out, packed=plan.packed, is_dummy=plan.is_dummy)
    state.moe.begin_microbatch(mb)  # the routers' hooks read this microbatch's routes and mask
    return mb


def forward(state: WorkerState, mb: Microbatch) -> torch.Tensor:
    """Logits of the microbatch (a vocab-sharded DTensor under TP)."""
    return model_lib.forward_logits(
        state.model,
        mb.input_ids,
        position_ids=mb.position_ids,
        autocast_dtype=state.dtype,
        cu_seqlens=mb.cu_seqlens,
        max_seqlen=mb.max_seqlen,
    )


def hidden_states(state: WorkerState, mb: Microbatch) -> torch.Tensor:
    """Last hidden states [b, T, H] (no grad); FSDP2 runs them through the root module, whose
    parameters (embeddings, final norm, head) then stay unsharded until `state.reshard()`."""
    return model_lib.forward_hidden(
        state.model,
        mb.input_ids,
        position_ids=mb.position_ids,
        autocast_dtype=state.dtype,
        cu_seqlens=mb.cu_seqlens,
        max_seqlen=mb.max_seqlen,
        through_root=state.parallel.mesh is not None,
    )

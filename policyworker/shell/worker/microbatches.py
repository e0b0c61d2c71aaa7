"""Microbatches on the device: validate a batch, plan it, cut it, run the model on a piece.

Microbatching (fixed / dynamic / packed) is planned by `policyworker.functional.batching` on what
this rank receives, padded with dummy microbatches up to the most any rank has, so every rank
runs the same number of forwards (FSDP2 and TP collectives stay in lockstep).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from policyworker.config import PolicyConfig
from policyworker.functional import batch_checks, batching
from policyworker.functional.batching import MicrobatchSpec
from policyworker.functional.packing import pack, packed_position_ids, packed_token_slots
from policyworker.shell.model import hf_model as model_lib
from policyworker.shell.worker.state import WorkerState

__all__ = [
    "Microbatch",
    "forward",
    "hidden_states",
    "load",
    "microbatch_spec",
    "plan",
    "to_device",
    "validate",
]


class Microbatch:
    """One microbatch on the device: model inputs plus the data the loss reads ([b, w] tensors).

    Everything shaped by the lengths (packing, position ids, document boundaries, the unpack
    slots) is computed on the host from `lengths` (CPU) and copied over asynchronously, so
    preparing a microbatch never waits for the device itself (a loss that reads its metrics
    with `float()` still does, once per microbatch).
    """

    def __init__(
        self,
        data: dict[str, Any],
        *,
        packed: bool,
        is_dummy: bool,
        lengths: torch.Tensor,
        host_ids: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.data = data
        self.packed = packed
        self.is_dummy = is_dummy
        self.lengths = lengths.to(torch.int64)  # CPU
        self.width = host_ids.shape[1]
        if packed:
            ids_N, cu_seqlens = pack(host_ids, self.lengths)
            self.input_ids = to_device(ids_N[None], device)
            self.position_ids = to_device(packed_position_ids(self.lengths)[None], device)
            self.cu_seqlens: torch.Tensor | None = to_device(cu_seqlens, device)
            self.max_seqlen: int | None = int(self.lengths.max()) if self.lengths.numel() else 0
            self._slots = to_device(packed_token_slots(self.lengths, self.width), device)
        else:
            self.input_ids = data["input_ids"]
            self.position_ids = torch.arange(self.width, device=self.input_ids.device).expand(
                self.input_ids.shape[0], -1
            )
            self.cu_seqlens, self.max_seqlen = None, None

    def unpack_rows(self, x_1N: torch.Tensor) -> torch.Tensor:
        """Packed [1, N, ...] -> [b, w, ...] zero-padded (identity for unpacked microbatches)."""
        if not self.packed:
            return x_1N
        rows = self.lengths.shape[0]
        out = x_1N.new_zeros((rows * self.width, *x_1N.shape[2:]))
        out = out.index_copy(0, self._slots, x_1N[0])  # differentiable, no host sync
        return out.reshape(rows, self.width, *x_1N.shape[2:])


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a CPU tensor bound for CUDA goes through page-locked memory, so the copy
    is queued without waiting for the device (a pageable copy would wait for the stream)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def validate(
    state: WorkerState,
    data: Mapping[str, Any],
    *,
    required=("input_ids", "input_lengths"),
    skip=(),
    needed_by: str = "",
) -> dict[str, Any]:
    """The batch as the worker reads it (token ids and lengths int64), after refusing one it
    cannot use (missing keys, shapes, mask types, token ids outside the model's vocabulary),
    before any work; `needed_by` names who reads the required keys."""
    state.require_running("a batch call (train, logprobs, top-k, score)")
    return batch_checks.check_batch(
        data,
        vocab_size=state.vocab_rows,
        required=required,
        skip=tuple(skip or ()),
        needed_by=needed_by,
    )


def plan(
    state: WorkerState,
    lengths: torch.Tensor,
    *,
    seq_len: int,
    mbs: int,
    purpose: Literal["train", "logprob"],
) -> list[batching.MicrobatchPlan]:
    """Fixed / dynamic / packed plans for this rank, plus dummies up to the all-rank max."""
    spec = microbatch_spec(state.cfg, purpose)
    plans = batching.plan_microbatches(spec, lengths, seq_len=seq_len, mbs=mbs)
    max_count = state.parallel.all_reduce_int(len(plans), op="max", axis="world")
    return plans + batching.dummy_microbatches(
        plans, batching.num_dummy_microbatches(len(plans), max_count)
    )


def microbatch_spec(cfg: PolicyConfig, purpose: Literal["train", "logprob"]) -> MicrobatchSpec:
    """The config's microbatching for a train or a logprob pass (each has its own budget)."""
    if cfg.dynamic_batching is not None:
        dyn = cfg.dynamic_batching
        return MicrobatchSpec(
            kind="dynamic",
            token_budget=dyn.train_mb_tokens if purpose == "train" else dyn.logprob_tokens,
            sequence_length_round=dyn.sequence_length_round,
        )
    if cfg.sequence_packing is not None:
        packing = cfg.sequence_packing
        return MicrobatchSpec(
            kind="packed",
            token_budget=packing.train_mb_tokens if purpose == "train" else packing.logprob_tokens,
            algorithm=packing.algorithm,
            pad_multiple=cfg.make_sequence_length_divisible_by,
        )
    return MicrobatchSpec()


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
    host: dict[str, torch.Tensor] = {}  # the rows as selected, before the copy to the device
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            t = value.index_select(0, index.to(value.device))
            if t.ndim >= 2 and key not in skip:
                t = t[:, :width]
            host[key], out[key] = t, to_device(t, state.device)
        else:
            out[key] = [value[i] for i in rows]
    host_ids = host["input_ids"][:, :width]  # cut even when check_dim_skip_keys names it
    mb = Microbatch(
        out,
        packed=plan.packed,
        is_dummy=plan.is_dummy,
        lengths=lengths.cpu(),
        host_ids=host_ids.cpu() if plan.packed else host_ids,  # only packing reads them
        device=state.device,
    )
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

"""Inference: logprobs, reference logprobs, top-k logits, reward scores, full logits over IPC.

Every function runs no-grad microbatches planned like training's (`shell.microbatches`), returns
[B, S, ...] CPU tensors in input row order and reshards FSDP2 roots afterwards. FP8 scale
calibration, which also runs the model without grad, lives in `shell.calibration`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

import policyworker.shell.worker.microbatches as mbatch
import policyworker.shell.worker.scoring_loop as scoring_loop
from policyworker.data import BatchedDataDict
from policyworker.errors import DataError
from policyworker.functional import batching
from policyworker.functional.logprobs import count_and_zero_neg_inf, logprobs_with_leading_zero
from policyworker.functional.padding import mask_from_lengths
from policyworker.functional.tokens import last_token_values
from policyworker.shell.ipc_logits import TeacherLogitsBuffer, logits_record
from policyworker.shell.model import hf_model as model_lib
from policyworker.shell.worker.state import WorkerState

__all__ = [
    "check_extra_scores",
    "check_k",
    "full_logits_ipc",
    "logprobs",
    "reference_model",
    "release_ipc_buffer",
    "run",
    "scores",
    "topk_logits",
]


def plans(
    state: WorkerState, data: Mapping[str, Any], micro_batch_size: int | None
) -> list[batching.MicrobatchPlan]:
    """This rank's inference microbatches (`logprob_batch_size` unless given), with dummies."""
    mbs = micro_batch_size or state.cfg.logprob_batch_size
    return mbatch.plan(
        state, data["input_lengths"], seq_len=data["input_ids"].shape[1], mbs=mbs, purpose="logprob"
    )


def run(
    state: WorkerState,
    data: Mapping[str, Any],
    micro_batch_size: int | None,
    per_microbatch: Callable[[mbatch.Microbatch], Any],
) -> Any:
    """Run `per_microbatch(mb) -> [b, w, ...]` (or a tuple of such) over all plans.

    Returns [B, S, ...] CPU tensors in input order: a tuple of them when `per_microbatch`
    returns a tuple (of any length), else one.
    """
    seq_len = data["input_ids"].shape[1]
    planned = plans(state, data, micro_batch_size)
    model_lib.set_training_mode(state.model, False)
    outputs: list[tuple[torch.Tensor, ...]] = []
    returns_tuple = False
    try:
        with torch.no_grad():
            for plan in planned:
                mb = mbatch.load(state, data, plan)
                out = per_microbatch(mb)
                if mb.is_dummy:
                    continue
                returns_tuple = isinstance(out, tuple)
                outs = out if isinstance(out, tuple) else (out,)
                outputs.append(tuple(_pad_seq(o, seq_len).cpu() for o in outs))
    finally:
        state.reshard()
    if not outputs:
        raise ValueError("the batch has no rows; pass at least one row")
    order = batching.rows_in_input_order(planned)
    result: tuple[torch.Tensor, ...] = tuple(
        torch.cat(parts)[order] for parts in zip(*outputs, strict=True)
    )
    return result if returns_tuple else result[0]


def check_k(key: str, k: Any) -> None:
    """``ValueError`` unless `k` (the argument `key`) is an int >= 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        msg = f"{key}={k!r} must be a positive int (how many top logits to return per position)"
        raise ValueError(msg)


def check_extra_scores(entropy: Any, top_k: Any) -> None:
    """The extra statistics `get_logprobs` may return (`entropy`, `top_k`), checked before
    any work."""
    if not isinstance(entropy, bool):
        msg = f"entropy={entropy!r} must be True or False (True adds the per-token entropy)"
        raise ValueError(msg)
    if top_k is not None:
        check_k("top_k", top_k)


def logprobs(
    state: WorkerState,
    data: Mapping[str, Any],
    micro_batch_size: int | None,
    *,
    replay_routes: bool = False,
    entropy: bool = False,
    top_k: int = 0,
) -> BatchedDataDict:
    """fp32 [B, S] logprobs: 0 at column 0 and at positions >= input_lengths; with
    `replay_routes` (and router replay configured) MoE routers follow `routed_experts`.

    From the same forward and LM-head chunks (`scoring_loop.inference_scores`): with `entropy`,
    fp32 [B, S] "entropy" on the logprobs' positions (0 where they are 0); with `top_k`, the
    "topk_logits" / "topk_indices" [B, S, k] of `topk_logits` (no shift, 0/0 at padding).
    """
    counts = [0]

    def per_mb(mb: mbatch.Microbatch) -> tuple[torch.Tensor, ...]:
        scores = scoring_loop.inference_scores(state, mb, entropy=entropy, top_k=top_k)
        lp = logprobs_with_leading_zero(scores["logprobs"], mb.lengths)
        if scoring_loop.filtering(state) and not mb.is_dummy:
            lp, num_neg_inf = count_and_zero_neg_inf(lp, scoring_loop.valid_mask(mb.data, mb.width))
            counts[0] += num_neg_inf
        out = [lp]
        if entropy:
            out.append(logprobs_with_leading_zero(scores["entropy"], mb.lengths))
        if top_k:
            out.extend(_masked_topk(mb, scores))
        return tuple(out)

    with state.moe.replaying(replay_routes):
        outs = list(run(state, data, micro_batch_size, per_mb))
    if counts[0]:
        warnings.warn(
            f"policy top-k/top-p mismatch: {counts[0]} valid token(s) had -inf "
            f"logprob under the sampling filters; they were set to 0",
            stacklevel=3,
        )
    result = BatchedDataDict(logprobs=outs.pop(0).float())
    if entropy:
        result["entropy"] = outs.pop(0).float()
    if top_k:
        result["topk_logits"], result["topk_indices"] = outs[0].float(), outs[1].to(torch.int64)
    return result


def _masked_topk(
    mb: mbatch.Microbatch, scores: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A microbatch's top-k values and ids, 0/0 at positions >= its lengths."""
    values, ids = scores["topk_logits"], scores["topk_indices"]
    valid = mask_from_lengths(mb.lengths, mb.width)[..., None].to(values.device)
    return (
        torch.where(valid, values, torch.zeros_like(values)),
        torch.where(valid, ids, torch.zeros_like(ids)),
    )


@contextlib.contextmanager
def reference_model(state: WorkerState) -> Iterator[None]:
    """Swap the reference weights in place (filters off, temperature kept); restore the policy
    weights and sampling even on error."""
    if state.reference_state is None:
        msg = (
            "use_reference_model() needs reference weights but the worker was built with "
            "init_reference_model=False"
        )
        raise ValueError(msg)
    live = state.live_state()
    saved = state.snapshot()
    sampling = state.sampling
    try:
        with torch.no_grad():
            for k, t in live.items():
                t.copy_(state.reference_state[k])
        state.sampling = sampling.unfiltered()
        with torch.no_grad():
            yield
    finally:
        state.sampling = sampling
        with torch.no_grad():
            for k, t in live.items():
                t.copy_(saved[k])


def topk_logits(
    state: WorkerState, data: Mapping[str, Any], k: int, micro_batch_size: int | None
) -> BatchedDataDict:
    """Top-k of temperature-scaled logits at every position (no shift), 0/0 at padding."""

    def per_mb(mb: mbatch.Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        return _masked_topk(mb, scoring_loop.inference_scores(state, mb, logprobs=False, top_k=k))

    values, indices = run(state, data, micro_batch_size, per_mb)
    return BatchedDataDict(topk_logits=values.float(), topk_indices=indices.to(torch.int64))


def scores(state: WorkerState, data: Mapping[str, Any], kind: str) -> BatchedDataDict:
    """Reward scores: [B] (bradley_terry, at the last token) or [B, S] (regression)."""
    mbs = state.cfg.batch_size or state.cfg.logprob_batch_size

    def per_mb(mb: mbatch.Microbatch) -> torch.Tensor:
        hidden = mbatch.hidden_states(state, mb)
        with model_lib.autocast_context(state.device, state.dtype):
            # nn.Module's __getattr__ types sub-attributes as Tensor | Module; this is an HF model.
            out = state.model.score(hidden)[..., 0].float()  # pyright: ignore[reportCallIssue]
        valid = mask_from_lengths(mb.lengths, mb.width).to(out.device)
        return torch.where(valid, out, torch.zeros_like(out))

    out = run(state, data, mbs, per_mb)
    if kind == "bradley_terry":
        out = last_token_values(out, data["input_lengths"].cpu())
    return BatchedDataDict(scores=out.float())


def full_logits_ipc(
    state: WorkerState, data: Mapping[str, Any], micro_batch_size: int | None = None
) -> dict[str, Any]:
    """``PolicyWorker.get_full_logits_ipc``: fp32 logits of every sample into the shared buffer.

    Logits are the model's raw output (no temperature), the local vocab shard under tensor
    parallelism, right-padded with zeros to the batch's sequence length.

    Returns ``{"per_sample_handles": [record per input row, in input order], "dp_rank"}``.

    Raises:
        ValueError: sequence packing or dynamic batching is enabled, or context parallelism is
            used (this worker's CP forward does not expose per-rank logits windows).
    """
    cfg = state.cfg
    if cfg.sequence_packing is not None or cfg.dynamic_batching is not None:
        msg = (
            "get_full_logits_ipc needs fixed microbatches; disable sequence_packing and "
            "dynamic_batching for the teacher worker"
        )
        raise DataError(msg)
    par = state.parallel
    if par.cp_size > 1:
        msg = (
            f"get_full_logits_ipc does not support context parallelism (cp_size="
            f"{par.cp_size}); run the teacher with context_parallel_size: 1"
        )
        raise ValueError(msg)
    data = mbatch.validate(state, data)
    seq_len = int(data["input_ids"].shape[1])
    planned = plans(state, data, micro_batch_size)
    rows_per_mb = max(len(p.rows) for p in planned)
    if state.logits_buffer is None:
        state.logits_buffer = TeacherLogitsBuffer()
    buffer = state.logits_buffer
    storage: torch.Tensor | None = None
    records: list[dict[str, Any]] = []
    model_lib.set_training_mode(state.model, False)
    try:
        with torch.no_grad():
            for buf_idx, plan in enumerate(planned):
                logits = mbatch.forward(state, mbatch.load(state, data, plan))
                if hasattr(logits, "to_local"):
                    # pyright narrows nothing on hasattr; only a DTensor has to_local.
                    logits = logits.to_local()  # vocab-parallel lm_head: this rank's shard  # pyright: ignore[reportAttributeAccessIssue]
                if plan.is_dummy:
                    continue
                vocab_local = int(logits.shape[-1])
                if storage is None:
                    storage = buffer.ensure(
                        (len(planned), rows_per_mb, seq_len, vocab_local),
                        torch.float32,
                        state.device,
                    )
                slot = storage[buf_idx, : len(plan.rows), :seq_len, :vocab_local]
                slot.zero_()
                slot[:, : logits.shape[1]].copy_(logits.float())
                records.extend(
                    logits_record(buffer, storage, par, buf_idx, j, row, seq_len, vocab_local)
                    for j, row in enumerate(plan.rows)
                )
        if storage is not None and storage.is_cuda:
            torch.cuda.synchronize(storage.device)  # the consumer must never see a partial copy
    finally:
        state.reshard()
    records.sort(key=lambda r: r["sample_index"])
    return {"per_sample_handles": records, "dp_rank": par.dp_rank}


def release_ipc_buffer(state: WorkerState) -> None:
    """``PolicyWorker.release_ipc_buffer``: drop the worker's logits storage and handle."""
    buffer, state.logits_buffer = state.logits_buffer, None
    if buffer is not None:
        buffer.release()


def _pad_seq(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Right-pad dim 1 of `x` with zeros to `seq_len`."""
    if x.ndim < 2 or x.shape[1] >= seq_len:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, seq_len - x.shape[1]))

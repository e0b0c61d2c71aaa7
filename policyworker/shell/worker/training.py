"""Training: the loop over global batches, its microbatches, the loss call and the optimizer step.

Written for a data-parallel group: the loss normalizers (valid samples, valid tokens) are
all-reduced over dp before any microbatch runs, each microbatch's loss is scaled by dp * cp
before backward (FSDP2 averages gradients over those ranks), and ranks with fewer microbatches
run zero-weighted dummies so every rank calls the same collectives. On one process the
collectives are identities.

Padding positions (>= input_lengths) never count: `token_mask` is masked by the lengths before
the loss sees it.

A call reads: `check_train_call` (validate: the worker's state, then the one check of the batch,
`batch_checks.check_train_batch`) -> `train`: plan (whole global batches over dp) -> effect (per
global batch: microbatches, backward, optimizer step) -> finish (free the gradients and step the
scheduler, also when the effect raised; the result and its timing metrics).
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import time
import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

import policyworker.shell.worker.microbatches as mbatch
import policyworker.shell.worker.scoring_loop as scoring_loop
from policyworker.functional import batch_checks, batching, staleness
from policyworker.functional.distillation import distillation_loss_input
from policyworker.functional.logprobs import count_and_zero_neg_inf
from policyworker.functional.loss_protocol import (
    LossInputType,
    LossType,
    check_loss_output,
    input_type_of,
    loss_type_of,
    metric_normalizations_of,
)
from policyworker.functional.metrics import advertised_reductions, scale_microbatch_metrics
from policyworker.functional.tokens import mask_within_lengths, valid_token_total
from policyworker.shell.model.hf_model import set_training_mode
from policyworker.shell.parallel import collectives
from policyworker.shell.worker.state import WorkerState

__all__ = ["check_train_call", "train"]

log = logging.getLogger(__name__)


def check_train_call(
    state: WorkerState,
    data: Mapping[str, Any],
    loss_fn: Any,
    *,
    eval_mode: bool,
    gbs: int | None,
    mbs: int | None,
    skip: tuple[str, ...] = (),
) -> batch_checks.TrainBatch:
    """Refuse a `train` call this worker cannot run, before any work; the checked batch (the
    one check of the data, `batch_checks.check_train_batch`) with the batch sizes to use."""
    state.require_running("a batch call (train, logprobs, top-k, score)")
    if not eval_mode and state.optimizer is None:
        msg = "train() needs an optimizer but the worker was built with init_optimizer=False"
        raise ValueError(msg)
    if (
        not eval_mode
        and state.device.type == "cpu"
        # nn.Module's __getattr__ types sub-attributes as Tensor | Module; this is an HF model.
        and state.model.config._attn_implementation == "flex_attention"  # pyright: ignore[reportAttributeAccessIssue]
    ):
        msg = (
            "attn_implementation 'flex_attention' has no backward on CPU; use 'auto' or "
            "'sdpa' for training on CPU (flex_attention works for inference)"
        )
        raise ValueError(msg)
    if "generation_versions" in data and "policy_version" not in data:
        rows = len(data["generation_versions"])
        data = {**data, "policy_version": torch.full((rows,), state.policy_version)}
    batch = batch_checks.check_train_batch(
        data,
        loss_fn,
        vocab_size=state.vocab_rows,
        dp_size=state.parallel.dp_size,
        gbs=gbs,
        mbs=mbs,
        default_gbs=state.cfg.train_global_batch_size,
        default_mbs=state.cfg.train_micro_batch_size,
        skip=skip,
    )
    state.moe.check_replay_data(batch.data)
    return batch


@attrs.define
class _Steps:
    """Optimizer steps applied so far in one `train` call (read on the error path too)."""

    applied: int = 0


def train(
    state: WorkerState,
    batch: batch_checks.TrainBatch,
    loss_fn: Any,
    *,
    eval_mode: bool,
    skip: tuple[str, ...],
) -> dict[str, Any]:
    """One optimizer step per whole global batch of the checked `batch`; the worker's `train`
    result.

    Whatever happens, the gradients are freed (``zero_grad(set_to_none=True)``) and the LR
    scheduler steps once if any optimizer step was applied: a loss that raises in global batch
    2 keeps batch 1's optimizer step and its scheduler step, and the error propagates.
    """
    # how each metric reduces, from the loss's advertised normalizers (checked before any work)
    reductions = advertised_reductions(metric_normalizations_of(loss_fn))
    start = time.perf_counter()
    _reset_peak_memory(state.device)
    dp, cp = state.parallel.dp_size, state.parallel.cp_size
    local_gbs = batch.gbs // dp
    num_gb = _num_global_batches(state, batch.data, batch.gbs)
    plans = _plan_global_batches(state, batch, num_gb)
    set_training_mode(state.model, not eval_mode)
    grad_ctx = torch.no_grad() if eval_mode else contextlib.nullcontext()
    losses, all_mb_metrics, lag_stats = [], {}, []
    grad_norm, skipped, steps = None, 0, _Steps()
    try:
        with (
            grad_ctx,
            state.moe.replaying(),
            state.moe.counting(not eval_mode),
            state.draft.capturing(),
        ):
            for g in range(num_gb):
                rows = slice(g * local_gbs, (g + 1) * local_gbs)
                gb_data = _at_version({k: v[rows] for k, v in batch.data.items()}, steps.applied)
                if "generation_versions" in gb_data:
                    lag_stats.append(_version_lag(gb_data))
                out = _train_global_batch(
                    state,
                    gb_data,
                    loss_fn,
                    eval_mode=eval_mode,
                    plans=plans[g],
                    num_gb=num_gb,
                    skip=skip,
                    dp_cp=dp * cp,
                    untrusted=batch.reason_untrusted(g),
                    steps=steps,
                    reductions=reductions,
                )
                mb_losses, mb_metrics, grad_norm, was_skipped = out
                skipped += int(was_skipped)
                losses.append(math.fsum(mb_losses))
                for m in mb_metrics:
                    for k, v in m.items():
                        all_mb_metrics.setdefault(k, []).append(v)
    finally:
        _finish_train_call(state, steps.applied)
    global_loss = state.parallel.all_reduce(
        torch.tensor(losses, dtype=torch.float32, device=state.parallel._collective_device()),
        axis="dp",
    ).cpu()
    return {
        "global_loss": global_loss,
        "grad_norm": grad_norm,
        "all_mb_metrics": all_mb_metrics,
        "metric_reductions": reductions,
        "rank": state.parallel.rank,
        "model_dtype": state.dtype,
        "skipped_steps": skipped,
        **_speed(state, batch.data["input_lengths"][: num_gb * local_gbs], start),
        **(_lag_metrics(state, lag_stats) if "generation_versions" in batch.data else {}),
    }


def _at_version(data: dict[str, Any], applied: int) -> dict[str, Any]:
    """A global batch trains under the call's starting policy version plus the optimizer steps
    this call applied before it; its rows' ``policy_version`` says so."""
    if "policy_version" in data and applied:
        data["policy_version"] = data["policy_version"] + applied
    return data


def _version_lag(data: Mapping[str, Any]) -> dict[str, float]:
    lag = staleness.version_lag(data["generation_versions"], data["policy_version"])
    return staleness.version_lag_stats(lag, batch_checks.counted_positions(data))


def _lag_metrics(state: WorkerState, stats: list[dict[str, float]]) -> dict[str, float]:
    """``max_version_lag`` and ``mean_version_lag`` of the tokens trained, over all dp ranks
    (policy version minus each token's version)."""
    tokens = sum(s["version_lag_tokens"] for s in stats)
    lag_sum = sum(s["mean_version_lag"] * s["version_lag_tokens"] for s in stats)
    totals = torch.tensor([lag_sum, tokens], dtype=torch.float64)
    dev = state.parallel._collective_device()
    lag_sum, tokens = state.parallel.all_reduce(totals.to(dev), axis="dp").cpu().tolist()
    worst = state.parallel.all_reduce_int(
        int(max((s["max_version_lag"] for s in stats), default=0)), op="max", axis="dp"
    )
    return {
        "max_version_lag": float(worst),
        "mean_version_lag": lag_sum / tokens if tokens else 0.0,
    }


def _plan_global_batches(
    state: WorkerState, batch: batch_checks.TrainBatch, num_gb: int
) -> list[list[batching.MicrobatchPlan]]:
    """The microbatch plans of every global batch, made before the first step: a row no
    microbatch can hold is refused before any weight changes."""
    local_gbs = batch.gbs // state.parallel.dp_size
    seq_len = batch.data["input_ids"].shape[1]
    return [
        mbatch.plan(
            state,
            batch.data["input_lengths"][g * local_gbs : (g + 1) * local_gbs],
            seq_len=seq_len,
            mbs=batch.mbs,
            purpose="train",
        )
        for g in range(num_gb)
    ]


def _speed(state: WorkerState, lengths_trained: torch.Tensor, start: float) -> dict[str, float]:
    """``step_time_s`` since `start`, this rank's ``tokens_per_s`` and ``peak_memory_bytes``."""
    step_time_s = time.perf_counter() - start
    tokens = int(lengths_trained.sum())
    return {
        "step_time_s": step_time_s,
        "tokens_per_s": tokens / step_time_s if step_time_s > 0 else 0.0,
        "peak_memory_bytes": _peak_memory_bytes(state.device),
    }


def _finish_train_call(state: WorkerState, applied: int) -> None:
    """Free the gradients, step the scheduler if an optimizer step was applied, and release
    the cache when configured; runs when `train` returns and when it raises."""
    if state.optimizer is not None:
        state.optimizer.zero_grad(set_to_none=True)
    if applied and state.scheduler is not None:
        state.scheduler.step()
    if state.cfg.dtensor_cfg.release_cache_after_train:  # NeMo-RL's behaviour; see the config
        state.empty_cache()


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this call on CUDA (allocated by tensors); on the CPU the process's peak
    resident set since it started (the OS keeps no per-call peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _num_global_batches(state: WorkerState, data: Mapping[str, Any], gbs: int) -> int:
    """Whole global batches in `data` over all dp ranks (a trailing partial one is dropped)."""
    size = int(data["input_ids"].shape[0])
    total = state.parallel.all_reduce_int(size, axis="dp")
    num_gb = total // gbs
    if num_gb == 0:
        msg = (
            f"the batch has {total} rows over all data-parallel ranks, fewer than one "
            f"global batch (gbs={gbs}); pass at least gbs rows or a smaller gbs"
        )
        raise ValueError(msg)
    if total % gbs:
        log.warning(
            "train(): %d row(s) over all data-parallel ranks are not a whole global "
            "batch (gbs=%d) and are not used; pass a multiple of gbs rows",
            total % gbs,
            gbs,
        )
    return num_gb


def _global_normalizers(
    state: WorkerState, batch: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(valid samples, valid tokens) over all dp ranks, and the batch with `token_mask` cut to
    the lengths."""
    seq_len = batch["input_ids"].shape[1]
    sample_mask = batch["sample_mask"].to(torch.float32)
    batch = dict(batch)
    if "token_mask" in batch:
        batch["token_mask"] = mask_within_lengths(batch["token_mask"], batch["input_lengths"])
    toks = valid_token_total(seq_len, batch.get("token_mask"), sample_mask)
    dev = state.parallel._collective_device()
    gvs = state.parallel.all_reduce(sample_mask.sum().reshape(()).to(dev), axis="dp")
    gvt = state.parallel.all_reduce(toks.reshape(()).to(dev), axis="dp")
    return gvs.to(state.device), gvt.to(state.device), batch


def _train_global_batch(
    state: WorkerState,
    batch,
    loss_fn,
    *,
    eval_mode,
    plans,
    num_gb,
    skip,
    dp_cp,
    untrusted,
    steps,
    reductions,
):
    gvs, gvt, batch = _global_normalizers(state, batch)
    state.draft.begin_global_batch(batch)
    if not eval_mode:
        _optimizer(state).zero_grad(set_to_none=True)
    mb_losses, mb_metrics, finite = [], [], True
    if (
        untrusted is not None and not eval_mode
    ):  # skipped below, by every rank (the flag is all-reduced)
        warnings.warn(f"train(): {untrusted}", stacklevel=4)
        finite = False
    lr = state.optimizer.param_groups[0]["lr"] if state.optimizer is not None else 0.0
    normalizers = {"global_valid_seqs": float(gvs), "global_valid_toks": float(gvt)}
    # Losses stay on the device until every microbatch ran: reading one would wait for its
    # backward, and the next microbatch's forward could not be queued behind it.
    real_losses: list[torch.Tensor] = []
    reported: list[bool] = []  # whether each real microbatch's loss and metrics are reported
    for plan in plans:
        mb = mbatch.load(state, batch, plan, skip=skip)
        loss, metrics = _loss(state, mb, loss_fn, gvs, gvt)
        draft_loss = state.draft.microbatch_loss(mb, metrics)  # 0.0 without a draft
        if mb.is_dummy:
            loss, draft_loss = loss * 0, draft_loss * 0
        if not eval_mode:
            ((loss + draft_loss) * dp_cp).backward()
        if mb.is_dummy:
            continue
        metrics = scale_microbatch_metrics(metrics, num_gb, reductions=reductions)
        metrics.update(lr=lr, **normalizers)
        real_losses.append(loss.detach().reshape(()))
        reported.append(metrics["num_valid_samples"] > 0)
        if reported[-1]:
            mb_metrics.append(metrics)
    if real_losses:
        values = torch.stack(real_losses).float().cpu().tolist()  # the one wait for them all
        finite = finite and all(math.isfinite(v) for v in values)
        mb_losses = [v for v, keep in zip(values, reported, strict=True) if keep]
    if eval_mode:
        return mb_losses, mb_metrics, None, False
    per_token = loss_type_of(loss_fn) == LossType.TOKEN_LEVEL
    if float(gvt if per_token else gvs) == 0:
        # Nothing in this global batch counts (all tokens/rows masked out): a step would only
        # advance the optimizer's clock (Adam's bias correction, the scheduler).
        log.warning(
            "train(): a global batch has no valid %s; its optimizer step was skipped",
            "tokens" if per_token else "rows",
        )
        _optimizer(state).zero_grad(set_to_none=True)
        grad_norm, skipped = 0.0, True
    else:
        grad_norm, skipped = _optimizer_step(state, finite)
        steps.applied += int(not skipped)
        state.policy_version += int(not skipped)
    state.moe.finish_step(applied=not skipped)
    state.draft.finish_step(applied=not skipped)
    for i, m in enumerate(mb_metrics):
        m["skipped_step"] = float(skipped and i == 0)
    return mb_losses, mb_metrics, grad_norm, skipped


def _loss(state: WorkerState, mb: mbatch.Microbatch, loss_fn, gvs, gvt):
    """The loss's (loss, metrics) on one microbatch, checked against the loss contract."""
    output = _call_loss(state, mb, loss_fn, gvs, gvt)
    owner = f"loss_fn {type(loss_fn).__name__}"
    return check_loss_output(output, owner=owner, needs_grad=torch.is_grad_enabled())


def _call_loss(state: WorkerState, mb: mbatch.Microbatch, loss_fn, gvs, gvt):
    # Every loss is called by keyword, as NeMo-RL calls it; the inputs follow its input_type
    # (read by value: NeMo-RL's own loss classes carry NeMo-RL's enum).
    logits = mbatch.forward(state, mb)
    kind = input_type_of(loss_fn)
    if kind in (LossInputType.LOGIT, LossInputType.DISTILLATION):
        if isinstance(logits, DTensor):
            # A LOGIT loss may do anything with the vocab dim: give it the full logits. The
            # gather is differentiable (each TP rank gets its vocab shard's gradient back).
            logits = logits.full_tensor()
        logits = mb.unpack_rows(logits)
        if state.sampling.temperature != 1.0:
            logits = logits / state.sampling.temperature
        if kind == LossInputType.LOGIT:
            return loss_fn(
                data=mb.data, global_valid_seqs=gvs, global_valid_toks=gvt, logits=logits
            )
        return loss_fn(
            data=mb.data,
            global_valid_seqs=gvs,
            global_valid_toks=gvt,
            **distillation_loss_input(logits, mb.data, loss_fn),
        )
    data = dict(mb.data)
    lp = scoring_loop.training_logprobs(state, mb, logits, filtered=True)
    if scoring_loop.filtering(state):
        valid = scoring_loop.valid_mask(data, mb.width)[:, 1:]
        lp, _ = count_and_zero_neg_inf(lp, valid)
        if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
            data["curr_logprobs_unfiltered"] = scoring_loop.training_logprobs(
                state, mb, logits, filtered=False
            )
    return loss_fn(data=data, global_valid_seqs=gvs, global_valid_toks=gvt, next_token_logprobs=lp)


def _optimizer(state: WorkerState) -> torch.optim.Optimizer:
    """The worker's optimizer, for a training (not eval) step."""
    if state.optimizer is None:  # train() refuses this up front; the check documents the invariant
        msg = "train() needs an optimizer but the worker was built with init_optimizer=False"
        raise ValueError(msg)
    return state.optimizer


def _optimizer_step(state: WorkerState, loss_finite: bool) -> tuple[float, bool]:
    """Clip and step, or skip the step on every rank when any rank saw a non-finite value."""
    total_norm = collectives.total_grad_norm(state.model.parameters(), state.parallel)
    bad = int(not loss_finite or not bool(torch.isfinite(total_norm).item()))
    bad = state.parallel.all_reduce_int(bad, op="max", axis="world")
    grad_norm = float(total_norm.item())
    if bad:
        warnings.warn(
            f"non-finite loss or grad norm ({grad_norm}); the optimizer step was "
            f"skipped (weights and optimizer state unchanged)",
            stacklevel=4,
        )
        _optimizer(state).zero_grad(set_to_none=True)
        return grad_norm, True
    if state.cfg.max_grad_norm is not None:
        params = [p for p in state.model.parameters() if p.grad is not None]
        collectives.clip_grads_(params, state.cfg.max_grad_norm, total_norm)
    _optimizer(state).step()
    return grad_norm, False

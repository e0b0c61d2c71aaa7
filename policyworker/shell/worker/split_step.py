"""A train step split over calls: open it, feed it batches one call at a time, then step.

NeMo-RL's split train-step surface (`begin_train_step`, `train_microbatch`, `finish_train_step`,
`abort_train_step`): a controller that streams a logical global batch in pieces (as rollouts
finish) runs forward and backward on each piece as it comes, and steps the optimizer once, at
the end. The global normalizers (valid rows, valid tokens over all dp ranks) are only known at
the end, so each piece's loss runs with both set to 1 (raw sums) and `finish` divides the
accumulated gradients, the losses and the metrics by the true counts before the step. That is
exact for losses linear in ``1 / count`` (every `masked_mean` loss), and bitwise equal to `train`
on the same rows in the same microbatches when the count is a power of two (dividing by it
commutes with every rounding); otherwise it differs by rounding only.

Every call is collective: all ranks open, feed (each its own rows, a dummy microbatch where a
rank has fewer), finish and abort together. One step is open at a time; a second `begin` is
refused, as is a piece without an open step. `abort` drops the gradients without a step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import attrs
import torch

import policyworker.shell.worker.microbatches as mbatch
import policyworker.shell.worker.training as training
from policyworker.functional.loss_protocol import (
    LossType,
    check_loss_output,
    loss_type_of,
    metric_normalizations_of,
)
from policyworker.functional.metrics import advertised_reductions, normalize_deferred_metrics
from policyworker.functional.tokens import mask_within_lengths, valid_token_total
from policyworker.shell.model.hf_model import set_training_mode
from policyworker.shell.parallel.agreed_checks import agreed_checks
from policyworker.shell.worker.state import WorkerState

__all__ = ["OpenStep", "SplitStepCalls", "TrainStepStateError"]


class TrainStepStateError(RuntimeError):
    """A split train-step call out of order (a second begin, a piece or finish with none open)."""


@attrs.define
class OpenStep:
    """What an open step has accumulated: the loss and batch sizes it was opened with, this
    rank's valid rows and tokens, and each real microbatch's raw loss and metrics."""

    loss_fn: Any
    gbs: int
    mbs: int
    started: float
    local_seqs: float = 0.0
    local_toks: float = 0.0
    tokens: int = 0
    calls: int = 0
    finite: bool = True
    raw_losses: list[float] = attrs.field(factory=list)
    raw_metrics: list[dict[str, float]] = attrs.field(factory=list)


class SplitStepCalls:
    """Mixed into PolicyWorker: the split train step over the worker's state."""

    _open_step: OpenStep | None = None

    def begin_train_step(
        self, loss_fn: Any, gbs: int | None = None, mbs: int | None = None
    ) -> None:
        """Open a train step for `loss_fn`: gradients cleared, nothing stepped. `gbs` / `mbs`
        default to the config's; `mbs` cuts each fed batch into microbatches."""
        state: WorkerState = self.state  # type: ignore[attr-defined]
        with agreed_checks(state.parallel, what="begin_train_step"):
            state.require_running("begin_train_step")
            if self._open_step is not None:
                raise TrainStepStateError(
                    "a train step is already open: call finish_train_step() or "
                    "abort_train_step() before begin_train_step()"
                )
            if state.optimizer is None:
                raise ValueError(
                    "begin_train_step() needs an optimizer but the worker was built with "
                    "init_optimizer=False"
                )
            if state.draft.model is not None:
                raise ValueError(
                    "begin_train_step(): draft co-training normalizes by the whole global "
                    "batch's token pairs, known only at the end of a split step; use train()"
                )
            advertised_reductions(metric_normalizations_of(loss_fn))  # refuse a bad mapping now
            step = OpenStep(
                loss_fn,
                gbs=int(gbs or state.cfg.train_global_batch_size),
                mbs=int(mbs or state.cfg.train_micro_batch_size),
                started=time.perf_counter(),
            )
        set_training_mode(state.model, True)
        state.optimizer.zero_grad(set_to_none=True)
        training._reset_peak_memory(state.device)
        self._open_step = step

    def train_microbatch(self, data: Mapping[str, Any]) -> None:
        """Forward and backward on this rank's rows `data` (cut into microbatches of the step's
        `mbs`), into the open step's gradients; returns nothing (see `finish_train_step`)."""
        state: WorkerState = self.state  # type: ignore[attr-defined]
        with agreed_checks(state.parallel, what="train_microbatch"):
            step = self._require_open_step("train_microbatch")
            rows = int(data["input_ids"].shape[0]) if "input_ids" in data else 0
            batch = training.check_train_call(
                state,
                data,
                step.loss_fn,
                eval_mode=False,
                gbs=max(rows, 1) * state.parallel.dp_size,
                mbs=step.mbs,
            )
        _feed(state, step, batch.data, untrusted=batch.reason_untrusted(0) is not None)

    def finish_train_step(self) -> dict[str, Any]:
        """Close the open step: the true counts over dp, gradients divided by the loss's one,
        clip and optimizer step (skipped, as in `train`, on a non-finite loss or gradient or
        when nothing counted), scheduler step. Returns what `train` returns for one global
        batch, plus `num_calls` (the batches fed since `begin_train_step`)."""
        state: WorkerState = self.state  # type: ignore[attr-defined]
        with agreed_checks(state.parallel, what="finish_train_step"):
            step = self._require_open_step("finish_train_step")
        try:
            return _finish(state, step)
        finally:
            self._open_step = None

    def abort_train_step(self) -> None:
        """Drop the open step's gradients and accumulators without stepping (no-op when none
        is open)."""
        state: WorkerState = self.state  # type: ignore[attr-defined]
        if state.optimizer is not None:
            state.optimizer.zero_grad(set_to_none=True)
        self._open_step = None

    def _require_open_step(self, call: str) -> OpenStep:
        if self._open_step is None:
            raise TrainStepStateError(
                f"{call}() needs an open train step: call begin_train_step(loss_fn) first"
            )
        return self._open_step


def _feed(state: WorkerState, step: OpenStep, data: Mapping[str, Any], *, untrusted: bool) -> None:
    """Forward and backward of every microbatch of `data` with both counts set to 1."""
    data = dict(data)
    if "token_mask" in data:
        data["token_mask"] = mask_within_lengths(data["token_mask"], data["input_lengths"])
    seq_len = int(data["input_ids"].shape[1])
    sample_mask = data["sample_mask"].to(torch.float32)
    step.local_seqs += float(sample_mask.sum())
    step.local_toks += float(valid_token_total(seq_len, data.get("token_mask"), sample_mask))
    step.tokens += int(data["input_lengths"].sum())
    step.calls += 1
    step.finite = step.finite and not untrusted
    one = torch.ones((), dtype=torch.float32, device=state.device)
    dp_cp = state.parallel.dp_size * state.parallel.cp_size
    plans = mbatch.plan(
        state, data["input_lengths"], seq_len=seq_len, mbs=step.mbs, purpose="train"
    )
    losses: list[torch.Tensor] = []
    metrics_of: list[dict[str, float]] = []
    with state.moe.replaying(), state.moe.counting(True):
        for plan in plans:
            mb = mbatch.load(state, data, plan)
            output = training._call_loss(state, mb, step.loss_fn, one, one)
            owner = f"loss_fn {type(step.loss_fn).__name__}"
            loss, metrics = check_loss_output(output, owner=owner, needs_grad=True)
            if mb.is_dummy:
                loss = loss * 0
            (loss * dp_cp).backward()
            if mb.is_dummy or not metrics["num_valid_samples"] > 0:
                continue
            losses.append(loss.detach().reshape(()))
            metrics_of.append({k: float(v) for k, v in metrics.items()})
    if losses:
        values = torch.stack(losses).float().cpu().tolist()  # the one wait for them all
        step.finite = step.finite and all(math.isfinite(v) for v in values)
        step.raw_losses.extend(values)
    step.raw_metrics.extend(metrics_of)


def _finish(state: WorkerState, step: OpenStep) -> dict[str, Any]:
    """The step itself, then `train`'s result for it."""
    dev = state.parallel._collective_device()
    counts = torch.tensor([step.local_seqs, step.local_toks], dtype=torch.float32, device=dev)
    seqs, toks = state.parallel.all_reduce(counts, axis="dp").cpu().tolist()
    per_token = loss_type_of(step.loss_fn) == LossType.TOKEN_LEVEL
    n = toks if per_token else seqs
    lr = state.optimizer.param_groups[0]["lr"] if state.optimizer is not None else 0.0
    applied = False
    try:
        if n == 0:
            training.log.warning(
                "finish_train_step(): the step has no valid %s; its optimizer step was skipped",
                "tokens" if per_token else "rows",
            )
            grad_norm, skipped = 0.0, True
        else:
            for p in state.model.parameters():
                if p.grad is not None:
                    p.grad.div_(n)
            grad_norm, skipped = training._optimizer_step(state, step.finite)
            applied = not skipped
            state.policy_version += int(applied)
        state.moe.finish_step(applied=applied)
    finally:
        training._finish_train_call(state, int(applied))
    normalizations = {k: str(v) for k, v in metric_normalizations_of(step.loss_fn).items()}
    reductions = advertised_reductions(normalizations)
    all_mb_metrics: dict[str, list[float]] = {}
    for i, raw in enumerate(step.raw_metrics):
        m = normalize_deferred_metrics(
            raw, normalizations, valid_toks=toks, valid_seqs=seqs, token_level=per_token
        )
        m.update(lr=lr, global_valid_seqs=seqs, global_valid_toks=toks)
        m["skipped_step"] = float(skipped and i == 0)
        for k, v in m.items():
            all_mb_metrics.setdefault(k, []).append(v)
    divisor = n if n > 0 else 1.0
    loss = math.fsum(v / divisor for v in step.raw_losses)
    global_loss = state.parallel.all_reduce(
        torch.tensor([loss], dtype=torch.float32, device=dev), axis="dp"
    ).cpu()
    elapsed = time.perf_counter() - step.started
    return {
        "global_loss": global_loss,
        "grad_norm": grad_norm,
        "all_mb_metrics": all_mb_metrics,
        "metric_reductions": reductions,
        "rank": state.parallel.rank,
        "model_dtype": state.dtype,
        "skipped_steps": int(skipped),
        "step_time_s": elapsed,
        "tokens_per_s": step.tokens / elapsed if elapsed > 0 else 0.0,
        "peak_memory_bytes": training._peak_memory_bytes(state.device),
        "num_calls": step.calls,
    }

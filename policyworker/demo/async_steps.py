"""The demo's asynchronous rollouts (``--async``, HF inference process): each step's rollouts
are sampled while the trainer's newest weights stream into the inference process, which swaps
them in between two decode steps; every token comes back tagged with the weights that sampled
it.

Versions: the inference process counts refits (its version ``i`` is the ``i``-th refit it
received, 0 the weights it loaded); the trainer records the ``policy_version`` each refit
carried, so a token's version maps onto the trainer's count of optimizer steps
(`policy_versions`), which is what ``train()`` measures the lag against.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from policyworker.demo.options import DemoOptions

__all__ = ["inflight_rollout", "policy_versions", "stall_ms"]


def inflight_rollout(
    worker: Any, infer: Any, opts: DemoOptions, *, step: int, sent: list[int], rows: int
) -> tuple[dict[str, Any], float]:
    """Step ``step``'s rollouts, sampled while the worker's weights stream in flight; the
    rollout (prompts, responses, generation logprobs and versions, swaps, scored logprobs under
    the weights just sent) and the stream's milliseconds. ``sent`` gets this refit's version."""
    task = opts.task
    prompts = task.grouped(task.prompts(seed=opts.seed, step=step))
    sent.append(worker.policy_version)
    infer.request(
        "generate",
        prompts=prompts.tolist(),
        response_len=task.response_len,
        seed=opts.seed * 100_003 + step,
        score_micro_batch_size=rows,
        score_version=len(sent),
        timeout_s=opts.timeout_s,
    )
    t0 = time.perf_counter()
    worker.stream_weights_via_ipc_zmq(timeout_s=opts.timeout_s)  # while the process samples
    refit_ms = (time.perf_counter() - t0) * 1e3
    rollout = infer.result("generate")
    rollout["prompts"] = prompts.tolist()
    return rollout, refit_ms


def policy_versions(tags: Any, sent: list[int]) -> torch.Tensor:
    """[N, S] int64: the trainer's policy version of each token (tag ``i`` >= 1 is refit ``i``,
    which carried ``sent[i - 1]``; tag 0 the weights both sides loaded, version 0)."""
    table = torch.tensor([0, *sent], dtype=torch.int64)
    return table[torch.as_tensor(tags, dtype=torch.int64)]


def stall_ms(rollout: dict[str, Any]) -> float:
    """The longest swap of this rollout in ms (0 without one): the only pause sampling saw."""
    return max((seconds for _, seconds in rollout.get("swaps", [])), default=0.0) * 1e3

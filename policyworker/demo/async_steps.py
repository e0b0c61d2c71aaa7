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

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from policyworker.demo.options import DemoOptions

__all__ = [
    "inflight_rollout",
    "logprobs_of_versions",
    "policy_versions",
    "stall_ms",
    "trainer_weights",
]


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
    if "stall_ms" in rollout:  # vLLM: one swap per step, timed by its worker
        return float(rollout["stall_ms"])
    return max((seconds for _, seconds in rollout.get("swaps", [])), default=0.0) * 1e3


@contextlib.contextmanager
def trainer_weights(worker: Any, saved: dict[str, torch.Tensor]) -> Iterator[None]:
    """``worker``'s model holds ``saved`` (a ``state.snapshot()``) inside; its own weights are
    restored on the way out, even on error."""
    live = worker.state.live_state()
    own = worker.state.snapshot()
    try:
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(saved[name])
        yield
    finally:
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(own[name])


def logprobs_of_versions(
    worker: Any,
    data: dict[str, Any],
    current: torch.Tensor,
    previous: tuple[int, dict[str, torch.Tensor]] | None,
) -> torch.Tensor:
    """[N, S]: the trainer's logprob of each token under the weights of its own
    ``generation_versions`` entry: ``current`` (``get_logprobs`` under the worker's weights)
    where the token carries ``worker.policy_version``, the ``previous`` (version, snapshot)
    weights' elsewhere. A token of any other version is an attribution error.

    Raises:
        RuntimeError: a response token carries a version neither the worker nor ``previous``
            holds.
    """
    versions = torch.as_tensor(data["generation_versions"])
    mask = torch.as_tensor(data["token_mask"]) != 0
    held = {worker.policy_version} | ({previous[0]} if previous is not None else set())
    seen = set(versions[mask].unique().tolist())
    if not seen <= held:
        msg = (
            f"rollout tokens carry policy versions {sorted(seen)} but the trainer holds the "
            f"weights of {sorted(held)} only; one refit in flight at a time leaves a lag of 1"
        )
        raise RuntimeError(msg)
    older = mask & (versions != worker.policy_version)
    if previous is None or not bool(older.any()):
        return current
    with trainer_weights(worker, previous[1]):
        old = worker.get_logprobs(data)["logprobs"]
    return torch.where(older, old, current)

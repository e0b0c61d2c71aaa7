"""The pure bookkeeping of a GRPO run: advantages, data order, which checkpoints stay, step metrics.

Shape legend: `P` prompts per step, `G` generations per prompt, `N = P * G` rollouts (groups
contiguous: rows `g*G .. g*G+G-1` answer prompt `g`).

Advantages follow NeMo-RL's `grpo.normalize_rewards` and `grpo.use_leave_one_out_baseline`:
the baseline of a rollout is the mean reward of the other rollouts of its prompt (leave one
out) or of all of them; the spread is sqrt(E[r^2] - E[r]^2) over the same set; with
normalisation the advantage `r - baseline` is divided by `spread + eps` wherever the spread is
above 0 (a group whose rewards tie keeps advantage 0, it is not sharpened). A group of one under
leave-one-out has no other rollout: its baseline is its own reward (advantage 0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "STEP_METRICS",
    "baseline_and_std",
    "checkpoints_to_remove",
    "grpo_advantages",
    "prompt_indices",
    "reduce_step_metrics",
    "response_length",
    "rollout_batch",
    "run_summary",
]


# The keys of `reduce_step_metrics`, one JSONL field each; checkpoints rank by one of them.
STEP_METRICS = (
    "reward_mean",
    "reward_std",
    "reward_min",
    "reward_max",
    "response_len_mean",
    "loss",
    "kl",
    "tokens_per_s",
    "refit_ms",
    "step_s",
)


def _groups(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    n = rewards_N.shape[0]
    if rewards_N.ndim != 1 or group_size < 1 or n % group_size != 0:
        msg = (
            f"rewards of shape {list(rewards_N.shape)} do not split into groups of "
            f"group_size={group_size}; pass a 1-d tensor whose length is a multiple of it"
        )
        raise ValueError(msg)
    return rewards_N.to(torch.float64).reshape(-1, group_size)


def baseline_and_std(
    rewards_N: torch.Tensor, group_size: int, *, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] baseline, [N] spread) per rollout, fp64, over its group (or the rest of it)."""
    r = _groups(rewards_N, group_size)
    if leave_one_out and group_size == 1:  # nobody else in the group: its own baseline
        return r.reshape(-1).clone(), torch.zeros(r.numel(), dtype=torch.float64)
    # who_GG[i, j]: rollout j counts toward rollout i's baseline (NeMo-RL's mask matrix);
    # the spread is taken around that baseline directly, so tied rewards give exactly 0.
    who_GG = torch.ones(group_size, group_size, dtype=torch.float64)
    if leave_one_out:
        who_GG -= torch.eye(group_size, dtype=torch.float64)
    count = who_GG.sum(dim=1)
    mean = (r @ who_GG.T) / count
    dev_PGG = r[:, None, :] - mean[:, :, None]
    std = ((dev_PGG * dev_PGG * who_GG).sum(dim=2) / count).sqrt()
    return mean.reshape(-1), std.reshape(-1)


def grpo_advantages(
    rewards_N: torch.Tensor,
    group_size: int,
    *,
    normalize_rewards: bool,
    leave_one_out: bool,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[N] fp32 advantages `r - baseline`, divided by `std + eps` where std > 0 if normalising."""
    baseline, std = baseline_and_std(rewards_N, group_size, leave_one_out=leave_one_out)
    adv = rewards_N.to(torch.float64) - baseline
    if normalize_rewards:
        spread = std > 0
        adv = torch.where(spread, adv / (std + eps), adv)
    return adv.to(torch.float32)


def prompt_indices(
    step: int, *, num_items: int, per_step: int, seed: int, shuffle: bool
) -> list[int]:
    """Dataset rows of RL step `step` (1-based): the run reads one long stream of epochs, each
    a permutation of `range(num_items)` drawn from (seed, epoch) (identity without `shuffle`),
    and step `k` takes positions `(k-1)*per_step ..` of it. A function of its arguments only, so a
    resumed run reads the same rows as an uninterrupted one."""
    if step < 1 or num_items < 1 or per_step < 1:
        msg = (
            f"step={step}, num_items={num_items}, per_step={per_step}: each must be >= 1; "
            f"steps count from 1 and a dataset needs a row"
        )
        raise ValueError(msg)
    orders: dict[int, list[int]] = {}
    rows: list[int] = []
    for pos in range((step - 1) * per_step, step * per_step):
        epoch, offset = divmod(pos, num_items)
        if epoch not in orders:
            if shuffle:
                g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
                orders[epoch] = [int(i) for i in torch.randperm(num_items, generator=g)]
            else:
                orders[epoch] = list(range(num_items))
        rows.append(orders[epoch][offset])
    return rows


def checkpoints_to_remove(
    saved: Sequence[tuple[int, float | None]], *, keep_top_k: int | None, higher_is_better: bool
) -> list[int]:
    """Steps whose checkpoints go, given (step, metric) of every committed one: NeMo-RL's rule
    keeps the `keep_top_k` best by metric (ties: the later step wins; a missing metric ranks
    last) and always the latest step; `None` keeps all."""
    if keep_top_k is None or len(saved) <= keep_top_k:
        return []
    if keep_top_k < 1:
        msg = f"keep_top_k={keep_top_k}: keep at least 1 checkpoint, or null to keep all"
        raise ValueError(msg)
    latest = max(step for step, _ in saved)

    def rank(entry: tuple[int, float | None]) -> tuple[bool, float, int]:
        step, metric = entry
        if metric is None or math.isnan(metric):
            return (False, 0.0, step)
        return (True, metric if higher_is_better else -metric, step)

    ranked = sorted(saved, key=rank, reverse=True)
    kept = {step for step, _ in ranked[:keep_top_k]} | {latest}
    return sorted(step for step, _ in saved if step not in kept)


def reduce_step_metrics(
    *,
    rewards_N: torch.Tensor,
    response_lengths_N: torch.Tensor,
    train_metrics: Mapping[str, float],
    step_s: float,
    refit_s: float,
) -> dict[str, float]:
    """One step's logged numbers: reward mean/std/min/max, mean response length, the training
    loss and KL (0 when the loss reports none), generated tokens per second of step time."""
    if rewards_N.numel() == 0 or step_s <= 0:
        msg = (
            f"{rewards_N.numel()} rewards, step_s={step_s}: a step has rollouts and takes time; "
            f"pass its rewards and a positive duration"
        )
        raise ValueError(msg)
    r = rewards_N.to(torch.float64)
    tokens = float(response_lengths_N.to(torch.float64).sum())
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "reward_min": float(r.min()),
        "reward_max": float(r.max()),
        "response_len_mean": tokens / r.numel(),
        "loss": float(train_metrics.get("loss", 0.0)),
        "kl": float(train_metrics.get("kl_penalty", 0.0)),
        "tokens_per_s": tokens / step_s,
        "refit_ms": refit_s * 1e3,
        "step_s": step_s,
    }


def run_summary(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Over the steps of a run: first and last reward, best reward, mean step time and
    tokens/s, total time; empty for no steps."""
    if not history:
        return {}
    rewards = [h["reward_mean"] for h in history]
    total = math.fsum(h["step_s"] for h in history)
    return {
        "steps": float(len(history)),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_best": max(rewards),
        "step_s_mean": total / len(history),
        "tokens_per_s_mean": math.fsum(h["tokens_per_s"] for h in history) / len(history),
        "total_s": total,
    }


def response_length(response: Sequence[int], *, eos_token_id: int | None) -> int:
    """Tokens of `response` that count: up to and including the first eos (all without one)."""
    if eos_token_id is not None and eos_token_id in response:
        return list(response).index(eos_token_id) + 1
    return len(response)


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_logprobs: Sequence[Sequence[float]],
    advantages_N: torch.Tensor,
    *,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """The worker's training batch of N rollouts of different lengths, right-padded to the
    longest: ids, lengths, loss mask on the response tokens only, per-token advantages and the
    sampler's logprobs at the response positions (0 elsewhere)."""
    n = len(prompts)
    if not n == len(responses) == len(response_logprobs) == advantages_N.shape[0]:
        msg = (
            f"{n} prompts, {len(responses)} responses, {len(response_logprobs)} logprob rows, "
            f"{advantages_N.shape[0]} advantages: pass one of each per rollout"
        )
        raise ValueError(msg)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    s = max(lengths)
    ids = torch.full((n, s), pad_token_id, dtype=torch.int64)
    mask = torch.zeros(n, s, dtype=torch.float32)
    gen = torch.zeros(n, s, dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, response_logprobs, strict=True)):
        if len(lp) != len(r):
            msg = f"rollout {i}: {len(r)} response tokens but {len(lp)} logprobs; pass one each"
            raise ValueError(msg)
        ids[i, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.int64)
        mask[i, len(p) : len(p) + len(r)] = 1.0
        gen[i, len(p) : len(p) + len(r)] = torch.tensor(lp, dtype=torch.float32)
    return {
        "input_ids": ids,
        "input_lengths": torch.tensor(lengths, dtype=torch.int64),
        "sample_mask": torch.ones(n, dtype=torch.float32),
        "token_mask": mask,
        "advantages": advantages_N.to(torch.float32)[:, None].expand(n, s).contiguous(),
        "generation_logprobs": gen,
    }

"""The demo's toy task, its reward and the GRPO bookkeeping. All functions are pure.

Task ("say the target token"): a prompt is `prompt_len` random tokens; the policy answers with
`response_len` tokens; the reward of an answer is the fraction of its tokens equal to
`target_token`. A randomly initialised model answers nearly uniformly, so its reward starts near
`1 / vocab_size` and GRPO has to find the target from group-relative advantages alone. The task
exercises the RL plumbing (sampling, refit, logprobs, loss), not a capability: the answer does
not depend on the prompt.

Shape legend: `P` prompts, `G` group size, `N = P * G` rollouts, `Lp` prompt length,
`Lr` response length, `S = Lp + Lr` sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from attrs import field, frozen
from attrs.validators import ge

__all__ = [
    "TargetTokenTask",
    "build_train_batch",
    "group_advantages",
    "logprob_mismatch",
    "reward_rose",
    "smoothed_ends",
]


@frozen(kw_only=True)
class TargetTokenTask:
    """Sizes of the toy task; one RL step samples `num_prompts * group_size` rollouts."""

    vocab_size: int = field(default=32, validator=ge(2))
    target_token: int = field(default=7, validator=ge(0))
    prompt_len: int = field(default=4, validator=ge(1))
    response_len: int = field(default=4, validator=ge(1))
    num_prompts: int = field(default=8, validator=ge(1))
    group_size: int = field(default=8, validator=ge(2))

    def __attrs_post_init__(self) -> None:
        if self.target_token >= self.vocab_size:
            msg = (
                f"target_token = {self.target_token} must be < vocab_size = {self.vocab_size}; "
                f"pick a token id inside the vocabulary"
            )
            raise ValueError(msg)

    @property
    def num_rollouts(self) -> int:
        return self.num_prompts * self.group_size

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    def prompts(self, *, seed: int, step: int) -> torch.Tensor:
        """[P, Lp] int64 prompts of RL step `step` (a function of (seed, step) only)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return torch.randint(0, self.vocab_size, (self.num_prompts, self.prompt_len), generator=g)

    def grouped(self, prompts_PL: torch.Tensor) -> torch.Tensor:
        """[N, Lp]: each prompt repeated `group_size` times, groups contiguous."""
        return prompts_PL.repeat_interleave(self.group_size, dim=0)

    def rewards(self, prompts_NL: torch.Tensor, responses_NR: torch.Tensor) -> torch.Tensor:
        """[N] fp32 reward in [0, 1]: fraction of response tokens equal to `target_token`."""
        if prompts_NL.shape[0] != responses_NR.shape[0]:
            msg = (
                f"prompts have {prompts_NL.shape[0]} rows but responses have "
                f"{responses_NR.shape[0]}; pass one response per (repeated) prompt"
            )
            raise ValueError(msg)
        return (responses_NR == self.target_token).to(torch.float32).mean(dim=1)


def group_advantages(
    rewards_N: torch.Tensor, group_size: int, *, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: (r - group mean) / (group std + eps); 0 for a group whose rewards tie.

    Raises:
        ValueError: `rewards_N` does not split into whole groups of `group_size`.
    """
    n = rewards_N.shape[0]
    if group_size < 1 or n % group_size != 0:
        msg = (
            f"{n} rewards do not split into groups of group_size={group_size}; use a divisor of {n}"
        )
        raise ValueError(msg)
    groups_PG = rewards_N.to(torch.float32).reshape(-1, group_size)
    centered = groups_PG - groups_PG.mean(dim=1, keepdim=True)
    std = groups_PG.std(dim=1, unbiased=False, keepdim=True)
    return (centered / (std + eps)).reshape(n)


def build_train_batch(
    task: TargetTokenTask,
    prompts_NL: torch.Tensor,
    responses_NR: torch.Tensor,
    advantages_N: torch.Tensor,
    generation_logprobs_NS: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The worker's batch: ids, lengths, masks (loss on response tokens only), advantages."""
    input_ids = torch.cat([prompts_NL, responses_NR], dim=1).to(torch.int64)
    n, s = input_ids.shape
    token_mask = torch.zeros(n, s, dtype=torch.float32)
    token_mask[:, task.prompt_len :] = 1.0
    return {
        "input_ids": input_ids,
        "input_lengths": torch.full((n,), s, dtype=torch.int64),
        "sample_mask": torch.ones(n, dtype=torch.float32),
        "token_mask": token_mask,
        "advantages": advantages_N.to(torch.float32)[:, None].expand(n, s).contiguous(),
        "generation_logprobs": generation_logprobs_NS.to(torch.float32),
    }


def smoothed_ends(values: Sequence[float], window: int) -> tuple[float, float]:
    """(mean of the first `window` values, mean of the last `window`); window is capped at len."""
    if not values:
        raise ValueError("no values to smooth; run at least one step")
    w = max(1, min(window, len(values)))
    return math.fsum(values[:w]) / w, math.fsum(values[-w:]) / w


def reward_rose(
    values: Sequence[float], *, window: int = 3, start_max: float = 0.2, end_min: float = 0.8
) -> bool:
    """True when the smoothed first reward is <= `start_max` and the smoothed last >= `end_min`."""
    first, last = smoothed_ends(values, window)
    return first <= start_max and last >= end_min


def logprob_mismatch(
    train_NS: torch.Tensor, gen_NS: torch.Tensor, mask_NS: torch.Tensor
) -> tuple[float, float]:
    """(NeMo-RL's `token_mult_prob_error`, max |train - gen|) over the tokens where mask is set.

    `token_mult_prob_error` is the mean over valid tokens of exp(|lp_train - lp_gen|): 1.0 for
    identical logprobs, above 1 by about the mean gap for small gaps.

    Raises:
        ValueError: the shapes differ or no token is valid.
    """
    if not train_NS.shape == gen_NS.shape == mask_NS.shape:
        msg = (
            f"train {list(train_NS.shape)}, gen {list(gen_NS.shape)} and mask "
            f"{list(mask_NS.shape)} must have one shape; pass [N, S] tensors of the same rows"
        )
        raise ValueError(msg)
    valid = mask_NS != 0
    if not bool(valid.any()):
        raise ValueError("mask selects no token; the mismatch is undefined without valid tokens")
    gap = (train_NS.double() - gen_NS.double()).abs()[valid]
    return float(gap.exp().mean()), float(gap.max())

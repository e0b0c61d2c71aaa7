"""Sampling: the generation settings logprobs are computed under, and vLLM's top-k/top-p filters.

Logprobs of a policy must match what the inference engine sampled from: logits divided by the
temperature, then (when set) restricted by top-k and top-p. The worker holds one `Sampling`
built from `generation`; the reference model and the KL term use `unfiltered()` (temperature
kept, filters off). The record validates itself, so every scorer that takes one (core chunked
logprobs, the shell's vocab-parallel and context-parallel paths) checks nothing again.

Shape legend: ``N`` rows, ``V`` vocab. All functions are pure: no communication, no device
queries, inputs are never mutated.
"""

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

__all__ = [
    "PLAIN_SAMPLING",
    "Sampling",
    "apply_sampling_filters",
    "check_temperature",
    "sampling_filters_active",
    "sampling_keep_mask",
]


def _top_k_active(top_k: int | None, vocab_size: int) -> bool:
    """True when top-k removes something. None, 0 and -1 mean "disabled" (vLLM / NeMo-RL)."""
    _check_top_k(top_k)
    return top_k is not None and top_k > 0 and top_k < vocab_size


def _check_top_k(top_k: int | None) -> None:
    if top_k is not None and top_k < -1:
        msg = f"top_k {top_k} must be a positive int, or None / 0 / -1 to disable top-k filtering"
        raise ValueError(msg)


def _check_top_p(top_p: float) -> None:
    if not 0.0 < top_p <= 1.0:
        msg = f"top_p {top_p} must be in (0, 1]; use 1.0 to disable top-p filtering"
        raise ValueError(msg)


def check_temperature(temperature: float) -> None:
    """``ValueError`` unless `temperature` is a finite number > 0."""
    if not (math.isfinite(temperature) and temperature > 0.0):
        msg = f"temperature {temperature} must be a finite number > 0; use 1.0 for unscaled logits"
        raise ValueError(msg)


def _validator(check: Callable[[Any], None]) -> Callable[[Any, Any, Any], None]:
    """An attrs field validator that runs `check` on the value (its message names the key)."""

    def validate(_instance: Any, _attribute: Any, value: Any) -> None:
        check(value)

    return validate


@attrs.frozen(kw_only=True)
class Sampling:
    """Temperature, top-k (None, 0 or -1: off) and top-p (1.0: off) of generation.

    Raises:
        ValueError: temperature is not finite and > 0, top_k < -1, or top_p outside (0, 1].
    """

    temperature: float = attrs.field(default=1.0, validator=_validator(check_temperature))
    top_k: int | None = attrs.field(default=None, validator=_validator(_check_top_k))
    top_p: float = attrs.field(default=1.0, validator=_validator(_check_top_p))

    @classmethod
    def of_generation(cls, generation: Any) -> "Sampling":
        """The settings of a `GenerationConfig` (None: plain softmax at temperature 1)."""
        if generation is None:
            return cls()
        return cls(
            temperature=generation.temperature, top_k=generation.top_k, top_p=generation.top_p
        )

    @property
    def filters_active(self) -> bool:
        """Whether top-k or top-p remove any token (filtered-out tokens get -inf logprobs)."""
        return sampling_filters_active(self.top_k, self.top_p)

    def unfiltered(self) -> "Sampling":
        """The same temperature with top-k and top-p off."""
        return Sampling(temperature=self.temperature)


# Temperature 1, no filters: the plain softmax, the default of every scorer.
PLAIN_SAMPLING = Sampling()


def sampling_filters_active(top_k: int | None, top_p: float) -> bool:
    """Whether `generation`'s top-k / top-p ask for any filtering (top_k of None, 0 or -1 and
    top_p of 1 mean none)."""
    return (top_k is not None and top_k > 0) or top_p < 1.0


def sampling_keep_mask(
    logits_NV: torch.Tensor, *, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor | None:
    """Bool mask (same shape) of the entries vLLM's sampler keeps, or None when nothing is filtered.

    top-k keeps every logit ``>=`` the k-th largest (ties with it are kept). top-p then works on
    the survivors: sort ascending, softmax, cumulative sum, remove entries whose cumsum
    ``<= 1 - top_p``, and always keep the largest. vLLM leaves the order of equal logits in that
    sort unspecified; here it is deterministic: among equal logits the higher vocab id is removed
    first, so the lowest-id maximum is always kept (the rule ``topk`` uses too). The mask is
    computed in fp32 and carries no gradient.
    """
    _check_top_p(top_p)
    vocab_size = logits_NV.shape[-1]
    use_k = _top_k_active(top_k, vocab_size)
    if not use_k and top_p >= 1.0:
        return None
    x = logits_NV.detach().float()
    keep = torch.ones_like(x, dtype=torch.bool)
    if use_k:
        assert top_k is not None
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        keep = x >= kth
    if top_p < 1.0:
        # Ascending sort with ties in *descending* id order (stable sort of the flipped row), so
        # equal logits are removed highest id first and the lowest-id maximum always survives.
        flipped = x.masked_fill(~keep, float("-inf")).flip(-1)
        sorted_x, flipped_order = torch.sort(flipped, dim=-1, stable=True)
        order = vocab_size - 1 - flipped_order
        cumulative = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        removed_sorted = cumulative <= 1.0 - top_p
        removed_sorted[..., -1] = False  # always keep the largest
        removed = torch.zeros_like(removed_sorted).scatter(-1, order, removed_sorted)
        keep = keep & ~removed
    return keep


def apply_sampling_filters(
    logits_NV: torch.Tensor, *, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """A new tensor: ``logits`` with ``-inf`` outside the vLLM top-k/top-p kept set (last dim).

    Gradient is straight-through on kept entries and zero on filtered ones. With no filter active
    the result is an equal copy.
    """
    keep = sampling_keep_mask(logits_NV, top_k=top_k, top_p=top_p)
    if keep is None:
        return logits_NV.clone()
    return logits_NV.masked_fill(~keep, float("-inf"))

"""The value types of the Tinker-style client, named and shaped as in the public `tinker.types`
where they exist (docs/training-client.md lists the differences)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

import torch
from attrs import field, frozen

__all__ = [
    "AdamParams",
    "Datum",
    "Done",
    "ForwardBackwardOutput",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsResponse",
]

T = TypeVar("T")


def _ints(tokens: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens)


@frozen
class ModelInput:
    """A token sequence (Tinker's `ModelInput` of one encoded-text chunk)."""

    tokens: tuple[int, ...] = field(converter=_ints)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        """The input of these token ids."""
        return cls(tuple(tokens))

    def to_ints(self) -> list[int]:
        """The token ids as a list."""
        return list(self.tokens)

    @property
    def length(self) -> int:
        """The number of tokens."""
        return len(self.tokens)


def as_tensor(value: Any, *, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor from a tensor, an array, a list or a `ModelInput`."""
    if isinstance(value, ModelInput):
        value = value.to_ints()
    return torch.as_tensor(value, dtype=dtype).reshape(-1)


@frozen(kw_only=True)
class Datum:
    """One sequence: `model_input` (N tokens) and the per-position `loss_fn_inputs` (each N
    long): ``target_tokens`` (the next token at every position), ``weights``, and for the RL
    losses ``logprobs`` (the sampler's) and ``advantages``."""

    model_input: ModelInput
    loss_fn_inputs: Mapping[str, Any]


@frozen(kw_only=True)
class AdamParams:
    """Adam hyperparameters of one `optim_step` (Tinker's defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0


@frozen(kw_only=True)
class SamplingParams:
    """How `sample` draws tokens: up to `max_tokens` at `temperature`, stopping after any token
    id in `stop`; `seed` makes the draw repeatable."""

    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop: tuple[int, ...] = field(default=(), converter=_ints)


@frozen(kw_only=True)
class SampledSequence:
    """One sample: its tokens, the sampler's logprob of each, and why it stopped."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["length", "stop"]


@frozen(kw_only=True)
class SampleResponse:
    """The `num_samples` continuations of one `sample` call."""

    sequences: list[SampledSequence]


@frozen(kw_only=True)
class ForwardBackwardOutput:
    """Per datum ``{"logprobs": [N] fp32}`` (the target tokens' logprobs under the weights the
    call saw) and the loss metrics (``loss:mean`` and the loss's own metrics, averaged)."""

    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@frozen(kw_only=True)
class OptimStepResponse:
    """The step's metrics: ``loss:mean``, ``grad_norm`` and ``skipped_steps`` (0 or 1)."""

    metrics: dict[str, float]


@frozen(kw_only=True)
class SaveWeightsResponse:
    """Where `save_weights_for_sampler` / `save_state` wrote (a folder path)."""

    path: str


@frozen
class Done(Generic[T]):
    """A finished call: `result()` returns its value at once (Tinker returns a future; this
    client runs every call before it returns)."""

    value: T

    def result(self, timeout: float | None = None) -> T:
        """The call's value (`timeout` is accepted for Tinker's signature; nothing waits)."""
        return self.value

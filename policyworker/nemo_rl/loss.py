"""The losses and loss helpers under NeMo-RL's names (`nemo_rl.algorithms.loss` and
`nemo_rl.algorithms.utils`), plus `prepare_loss_input`.

The `*LossConfig` faces are built as NeMo-RL's are: the keys given, read back as attributes with
the loss's defaults, extra keys allowed, and the rules between keys checked when the loss is
built from it (`ClippedPGLossFn(cfg)` raises the `ConfigError`, an AssertionError as NeMo-RL's).
The core's attrs configs (`ClippedPGConfig`, ...) check everything when they are built."""

from typing import Any, ClassVar

import attrs
from torch import Tensor

from policyworker.functional import loss as core_loss
from policyworker.functional.distillation import DistillationConfig, DistillationLossFn
from policyworker.functional.loss import (
    ClippedPGConfig,
    DPOConfig,
    LossFunction,
    LossInputType,
    LossType,
    MetricNormalizer,
    calculate_kl,
    masked_mean,
)
from policyworker.nemo_rl.logits import prepare_loss_input

# NeMo-RL's positional order of a loss call: the model input first, then the batch and counts.
_INPUT_NAME = {
    LossInputType.LOGPROB: "next_token_logprobs",
    LossInputType.LOGIT: "logits",
}


class _PositionalCall:
    """NeMo-RL's positional call `loss_fn(next_token_logprobs, data, global_valid_seqs,
    global_valid_toks)` (`logits` first for a LOGIT loss) beside the keyword call the worker
    makes; the core losses take keywords only."""

    input_type: LossInputType

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], Tensor) and self.input_type in _INPUT_NAME:
            names = (_INPUT_NAME[self.input_type], "data", "global_valid_seqs", "global_valid_toks")
            if len(args) > len(names):
                msg = f"{type(self).__name__} takes at most {len(names)} positional arguments"
                raise TypeError(msg)
            kwargs.update(zip(names, args, strict=False))
            args = ()
        return super().__call__(*args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]


class ClippedPGLossFn(_PositionalCall, core_loss.ClippedPGLossFn):
    """`ClippedPGLossFn`, also called positionally as NeMo-RL calls it."""


class NLLLossFn(_PositionalCall, core_loss.NLLLossFn):
    """`NLLLossFn`, also called positionally as NeMo-RL calls it."""


class DPOLossFn(_PositionalCall, core_loss.DPOLossFn):
    """`DPOLossFn`, also called positionally as NeMo-RL calls it."""


class _LossConfigFace(dict[str, Any]):
    """A loss config as NeMo-RL builds one: the given keys (a mapping the loss reads), each
    field also an attribute, unset fields reading the loss's default."""

    core: ClassVar[type[Any]]

    def __init__(self, **given: Any) -> None:
        super().__init__(given)

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        fields = {a.name: a for a in attrs.fields(self.core)}
        if name not in fields:
            msg = f"{type(self).__name__} has no key {name!r}"
            raise AttributeError(msg)
        default: Any = fields[name].default
        factory = getattr(default, "factory", None)  # an attrs Factory: make the default
        return factory() if callable(factory) else default


class ClippedPGLossConfig(_LossConfigFace):
    """NeMo-RL's `ClippedPGLossConfig`; its keys and defaults are `ClippedPGConfig`'s."""

    core = ClippedPGConfig


class DPOLossConfig(_LossConfigFace):
    """NeMo-RL's `DPOLossConfig`; its keys and defaults are `DPOConfig`'s."""

    core = DPOConfig


class DistillationLossConfig(_LossConfigFace):
    """NeMo-RL's `DistillationLossConfig`; its keys and defaults are `DistillationConfig`'s."""

    core = DistillationConfig


__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "LossFunction",
    "LossInputType",
    "LossType",
    "MetricNormalizer",
    "NLLLossFn",
    "calculate_kl",
    "masked_mean",
    "prepare_loss_input",
]

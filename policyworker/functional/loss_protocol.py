"""The loss contract: ``LossType``, ``LossInputType`` and the ``LossFunction`` protocol a loss
implements to be trained with (docs/custom-loss.md). All functions are pure.
"""

import enum
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from torch import Tensor

__all__ = [
    "LossFunction",
    "LossInputType",
    "LossType",
    "MetricNormalizer",
    "Metrics",
    "check_loss_output",
    "input_type_of",
    "loss_type_of",
    "metric_normalizations_of",
]

Metrics = dict[str, float]
_E = TypeVar("_E", bound=enum.StrEnum)


class LossType(enum.StrEnum):
    """How the loss is normalized: per valid token or per valid sequence."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class MetricNormalizer(enum.StrEnum):
    """The global count a loss divided a metric by: ``TOKENS`` (``global_valid_toks``),
    ``SEQUENCES`` (``global_valid_seqs``) or ``NONE`` (a raw count, a local mean, an extreme).

    A loss advertises it per metric in a ``metric_normalizations`` mapping (NeMo-RL's
    attribute); the worker reduces a ``TOKENS``/``SEQUENCES`` metric as a share of the global
    batch (summed over microbatches, whatever its name), a ``NONE`` one by its name (extremes by
    min/max, the rest summed), and a metric not advertised by its name as before.
    """

    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


def metric_normalizations_of(loss_fn: Any) -> dict[str, MetricNormalizer]:
    """The loss's advertised ``metric_normalizations`` ({} without the attribute).

    Raises:
        ValueError: the attribute is not a mapping of metric names to normalizer names.
    """
    advertised = getattr(loss_fn, "metric_normalizations", None)
    if advertised is None:
        return {}
    owner = type(loss_fn).__name__
    if not isinstance(advertised, Mapping):
        msg = (
            f"{owner}.metric_normalizations is {_describe(advertised)}; expected a mapping "
            "from metric name to MetricNormalizer (tokens, sequences or none)"
        )
        raise ValueError(msg)
    result: dict[str, MetricNormalizer] = {}
    for key, value in cast("Mapping[Any, Any]", advertised).items():
        name = getattr(value, "value", value)
        if name not in MetricNormalizer.__members__.values():
            msg = (
                f"{owner}.metric_normalizations[{key!r}] is {value!r}; expected one of "
                f"{[m.value for m in MetricNormalizer]} (MetricNormalizer)"
            )
            raise ValueError(msg)
        result[str(key)] = MetricNormalizer(name)
    return result


class LossInputType(enum.StrEnum):
    """What the worker passes besides ``data`` (by keyword, as NeMo-RL does): LOGPROB
    ``next_token_logprobs`` [B, S-1]; LOGIT ``logits`` [B, S, V]; DISTILLATION
    ``student_topk_logprobs`` and ``teacher_topk_logprobs`` [B, S-1, K] and ``H_all`` [B, S-1]
    or None (see `policyworker.functional.distillation`)."""

    LOGPROB = "logprob"
    LOGIT = "logit"
    DISTILLATION = "distillation"


def loss_type_of(loss_fn: Any) -> LossType:
    """The loss's ``loss_type`` as a ``LossType``, read by its value: a loss defining its own
    enum of the same values (NeMo-RL's loss modules, used verbatim) is read as ours.

    Raises:
        ValueError: the value is none of LossType's.
    """
    return _member_of(LossType, loss_fn, "loss_type")


def input_type_of(loss_fn: Any) -> LossInputType:
    """The loss's ``input_type`` as a ``LossInputType``, read by its value (as `loss_type_of`).

    Raises:
        ValueError: the value is none of LossInputType's (the inputs this worker can pass).
    """
    return _member_of(LossInputType, loss_fn, "input_type")


def _member_of(kind: type[_E], loss_fn: Any, attribute: str) -> _E:
    given = getattr(loss_fn, attribute, None)
    value = getattr(given, "value", given)
    known = [m.value for m in kind]
    if not isinstance(value, str) or value not in known:
        msg = (
            f"loss_fn {type(loss_fn).__name__}.{attribute} is {given!r}; expected a "
            f"{kind.__name__} (value one of {known}), e.g. {kind.__name__}.{next(iter(kind)).name}"
        )
        raise ValueError(msg)
    return kind(value)


@runtime_checkable
class LossFunction(Protocol):
    """A loss the worker can train with (a NeMo-RL custom loss ports by changing imports).

    The contract, in full with a tested example in docs/custom-loss.md: the worker calls
    ``loss_fn(data=mb, global_valid_seqs=gvs, global_valid_toks=gvt, **inputs)`` once per
    microbatch, every argument by keyword (``inputs`` by ``input_type``; ``next_token_logprobs``
    [b, s-1] lines up with ``data[key][:, 1:]``). ``global_valid_toks`` is the number of tokens
    counted in the whole global batch (``token_mask[:, 1:] · sample_mask`` over every
    microbatch and data-parallel rank), ``global_valid_seqs`` the sum of ``sample_mask`` there;
    both are 0-d fp32 tensors. The loss returns ``(loss, metrics)``: ``loss`` a 0-d floating
    tensor divided by the global count (so the microbatch losses sum to the global-batch mean),
    ``metrics`` a dict of numbers with ``num_valid_samples`` (this microbatch's valid rows). A
    return that breaks this raises ``ValueError`` saying what was expected. An optional
    ``required_keys`` tuple names the batch keys the loss reads (checked before any work).
    """

    loss_type: LossType
    input_type: LossInputType
    # Optional: ``metric_normalizations: Mapping[str, MetricNormalizer]`` (see MetricNormalizer).

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor,
        global_valid_toks: Tensor,
        **inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """Return the globally normalized 0-d loss and metrics including ``num_valid_samples``."""
        ...


_EXPECTED = (
    "a tuple (loss, metrics): loss a 0-d floating-point tensor computed from the inputs "
    "(divided by global_valid_toks or global_valid_seqs), metrics a dict of numbers with "
    "'num_valid_samples' (docs/custom-loss.md)"
)


def check_loss_output(
    output: Any, *, owner: str, needs_grad: bool
) -> tuple[Tensor, dict[str, Any]]:
    """``(loss, metrics)`` of one loss call, after checking it is what the contract says.

    Raises:
        ValueError: naming what the loss returned and what was expected.
    """
    if not isinstance(output, tuple | list) or len(output) != 2:  # pyright: ignore[reportUnknownArgumentType]
        msg = f"{owner} returned {_describe(output)}; expected {_EXPECTED}"
        raise ValueError(msg)
    loss, metrics = output  # pyright: ignore[reportUnknownVariableType]
    if not isinstance(loss, Tensor) or loss.ndim != 0 or not loss.dtype.is_floating_point:
        msg = (
            f"{owner} returned loss {_describe(loss)}; expected a 0-d floating-point tensor "
            f"(reduce per-token values with masked_mean(..., global_normalization_factor="
            f"global_valid_toks)): {_EXPECTED}"
        )
        raise ValueError(msg)
    if needs_grad and not loss.requires_grad:
        msg = (
            f"{owner} returned a loss that does not require grad, so training cannot "
            f"backpropagate it; compute it from the logprobs / logits passed (not from detached "
            f"copies or .item() values): {_EXPECTED}"
        )
        raise ValueError(msg)
    if not isinstance(metrics, Mapping):
        msg = f"{owner} returned metrics {_describe(metrics)}; expected {_EXPECTED}"
        raise ValueError(msg)
    # a copy: the worker adds its own entries (lr, the normalizers) to the dict it reports
    checked: dict[str, Any] = {str(k): v for k, v in cast("Mapping[Any, Any]", metrics).items()}
    count = checked.get("num_valid_samples")
    if not _is_number(count):
        keys = sorted(checked)
        msg = (
            f"{owner} returned metrics without a number under 'num_valid_samples' (keys: {keys}, "
            f"value: {_describe(count)}); add the valid rows of this microbatch, e.g. "
            f"float(data['sample_mask'].sum()): {_EXPECTED}"
        )
        raise ValueError(msg)
    return loss, checked


def _is_number(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.dtype.is_complex
    return isinstance(value, int | float) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} item(s)"  # pyright: ignore[reportUnknownArgumentType]
    return f"{type(value).__name__} {value!r}"[:120]

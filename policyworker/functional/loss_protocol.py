"""The loss contract: ``LossType``, ``LossInputType`` and the ``LossFunction`` protocol a loss
implements to be trained with (docs/custom-loss.md). All functions are pure.
"""

import enum
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["LossFunction", "LossInputType", "LossType", "Metrics"]

Metrics = dict[str, float]


class LossType(enum.StrEnum):
    """How the loss is normalized: per valid token or per valid sequence."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(enum.StrEnum):
    """What the worker passes besides ``data`` (by keyword, as NeMo-RL does): LOGPROB
    ``next_token_logprobs`` [B, S-1]; LOGIT ``logits`` [B, S, V]; DISTILLATION
    ``student_topk_logprobs`` and ``teacher_topk_logprobs`` [B, S-1, K] and ``H_all`` [B, S-1]
    or None (see `policyworker.functional.distillation`)."""

    LOGPROB = "logprob"
    LOGIT = "logit"
    DISTILLATION = "distillation"


@runtime_checkable
class LossFunction(Protocol):
    """A loss the worker can train with (a NeMo-RL custom loss ports by changing imports)."""

    loss_type: LossType
    input_type: LossInputType

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor,
        global_valid_toks: Tensor,
        **inputs: Tensor,
    ) -> tuple[Tensor, Metrics]:
        """Return the globally normalized 0-d loss and metrics including ``num_valid_samples``."""
        ...

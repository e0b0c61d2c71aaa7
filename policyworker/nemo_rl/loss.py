"""The losses and loss helpers under NeMo-RL's names (`nemo_rl.algorithms.loss` and
`nemo_rl.algorithms.utils`), plus `prepare_loss_input`."""

from policyworker.functional.distillation import DistillationLossConfig, DistillationLossFn
from policyworker.functional.loss import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    DPOLossConfig,
    DPOLossFn,
    LossFunction,
    LossInputType,
    LossType,
    MetricNormalizer,
    NLLLossFn,
    calculate_kl,
    masked_mean,
)
from policyworker.nemo_rl.logits import prepare_loss_input

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

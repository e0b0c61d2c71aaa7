"""A Tinker-style training client over a `PolicyWorker`: `TrainingClient` (forward_backward,
forward, optim_step, save_weights_for_sampler, save_state / load_state, sample), its value
types, and `HFSampler`, the in-process Hugging Face engine it samples through.
docs/training-client.md says how it differs from Tinker's client."""

from policyworker.training_client.client import SamplingClient, TrainingClient
from policyworker.training_client.sampler import HFSampler
from policyworker.training_client.types import (
    AdamParams,
    Datum,
    Done,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsResponse,
)

__all__ = [
    "AdamParams",
    "Datum",
    "Done",
    "ForwardBackwardOutput",
    "HFSampler",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SaveWeightsResponse",
    "TrainingClient",
]

"""A Tinker-style training client over a `PolicyWorker`: `TrainingClient` (forward_backward,
forward, optim_step, save_weights_for_sampler, save_state / load_state, sample), its value
types, and `HFSampler`, the in-process Hugging Face engine it samples through (`VllmSampler`:
a vLLM engine). Calls, argument names, `Datum` layout and loss names follow the public Tinker
client; docs/training-client.md has a worked loop.

Differences from the public Tinker client:

- **Synchronous.** Every call runs before it returns a `Done`, whose `result()` gives the value
  at once (`client.forward_backward(...).result()` works unchanged); no `*_async` variants.
- **Deferred backward.** `forward_backward` computes loss and logprobs and keeps the data;
  `optim_step` runs the backward of the kept data and the step as one global batch (the same
  gradient, one extra forward per datum). All `forward_backward` calls before one `optim_step`
  use the same loss; `load_state` drops kept data.
- **Loss normalization.** Losses are means over the step's weighted tokens (Tinker's are sums):
  scale `learning_rate` when porting a tuned run. `weights` act as the worker's `token_mask`.
- **Clipping and schedule.** No `grad_clip_norm` in `AdamParams` (the worker's `max_grad_norm`
  applies); `learning_rate` overrides the worker's LR scheduler on each step.
- **Datums.** `target_tokens` must be `model_input` shifted by one; image and other chunk types
  are not supported.
- **Sampling.** `sample` is also on the training client; a `SamplingClient` samples whatever its
  sampler was last given (not a snapshot). `SamplingParams` has no `top_k` / `top_p`; `stop` is
  token ids, not strings.
- **Weights for the sampler.** `save_weights_for_sampler` writes a PEFT folder and loads it into
  the sampler in this process; paths are folders, not ``tinker://`` URIs. An engine elsewhere
  takes the adapter alone over ZMQ (`VllmRefit(llm, worker, lora=True)`), outside the client.
- **Single process.** One worker in this process: no Ray, no data-parallel group.
"""

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

"""`VllmSampler`: a vLLM engine as the sampler of a `TrainingClient`.

Each `save_weights_for_sampler` folder (a PEFT LoRA adapter) becomes a new LoRA version of the
engine (`VllmAdapterVersions.register`); `sample` generates with the newest version (the base
model before the first). The engine must be built with ``enable_lora=True`` and a
``max_lora_rank`` at least the adapter's rank.
"""

from __future__ import annotations

import pathlib
from typing import Any

from policyworker.shell.engines.vllm_lora import VllmAdapterVersions
from policyworker.training_client.types import (
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
)

__all__ = ["VllmSampler"]


class VllmSampler:
    """Samples from `llm` (a ``vllm.LLM``) with the adapter last given to `load_adapter`."""

    def __init__(self, llm: Any, *, keep: int = 2) -> None:
        self.llm = llm
        self.versions = VllmAdapterVersions(llm, keep=keep)

    def load_adapter(self, folder: str | pathlib.Path) -> None:
        """Serve the PEFT adapter in `folder` from now on (a new engine LoRA version)."""
        self.versions.register(folder)

    def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        """`num_samples` continuations of `prompt` (each token's logprob under the engine)."""
        import vllm

        p = sampling_params
        params = vllm.SamplingParams(
            n=num_samples,
            temperature=p.temperature,
            max_tokens=p.max_tokens,
            seed=p.seed,
            stop_token_ids=list(p.stop),
            logprobs=0,
            detokenize=False,
        )
        request = self.versions.current if self.versions.version else None
        (out,) = self.llm.generate(
            [{"prompt_token_ids": prompt.to_ints()}], params, use_tqdm=False, lora_request=request
        )
        sequences = []
        for completion in out.outputs:
            tokens = list(completion.token_ids)
            logprobs = [d[t].logprob for d, t in zip(completion.logprobs, tokens, strict=True)]
            stopped = completion.finish_reason == "stop"
            sequences.append(
                SampledSequence(
                    tokens=tokens, logprobs=logprobs, stop_reason="stop" if stopped else "length"
                )
            )
        return SampleResponse(sequences=sequences)

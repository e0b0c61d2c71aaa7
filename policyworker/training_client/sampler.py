"""`HFSampler`: the in-process Hugging Face engine a `TrainingClient` samples through.

It holds its own fp32 copy of the base model (loaded from the worker's model folder); a
`save_weights_for_sampler` folder (PEFT LoRA) is loaded into it with `load_adapter`. Sampling
is plain autoregressive decoding without a KV cache (tiny models, tests and demos); the
logprob of each sampled token is the fp32 log_softmax of the temperature-scaled logits.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from policyworker.shell.model.peft_adapter import load_peft_adapter
from policyworker.training_client.types import (
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
)

__all__ = ["HFSampler"]


class HFSampler:
    """A Hugging Face causal LM on `device` that samples and takes adapter folders."""

    def __init__(self, model_path: str, *, device: str | torch.device = "cpu") -> None:
        import transformers

        model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32
        )
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.adapter_path: str | None = None

    def load_adapter(self, folder: str | pathlib.Path) -> None:
        """Serve the PEFT LoRA adapter in `folder` from now on (values copied in place)."""
        load_peft_adapter(self.model, folder)
        self.adapter_path = str(folder)

    @torch.no_grad()
    def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        """`num_samples` continuations of `prompt`."""
        p = sampling_params
        if num_samples < 1 or p.max_tokens < 1 or p.temperature <= 0 or prompt.length == 0:
            msg = (
                f"sample: num_samples={num_samples} and max_tokens={p.max_tokens} must be >= 1, "
                f"temperature={p.temperature} > 0 and the prompt non-empty ({prompt.length} "
                "tokens)"
            )
            raise ValueError(msg)
        gen = torch.Generator().manual_seed(p.seed if p.seed is not None else 0)
        ids = torch.tensor([prompt.to_ints()] * num_samples, device=self.device)
        tokens: list[list[int]] = [[] for _ in range(num_samples)]
        logprobs: list[list[float]] = [[] for _ in range(num_samples)]
        stopped = [False] * num_samples
        for _ in range(p.max_tokens):
            logits = self.model(input_ids=ids, use_cache=False).logits[:, -1].float().cpu()
            logp = torch.log_softmax(logits / p.temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            picked = logp.gather(-1, tok)[:, 0]
            for n in range(num_samples):
                if not stopped[n]:
                    tokens[n].append(int(tok[n]))
                    logprobs[n].append(float(picked[n]))
                    stopped[n] = int(tok[n]) in p.stop
            if all(stopped):
                break
            ids = torch.cat([ids, tok.to(self.device)], dim=1)
        return SampleResponse(
            sequences=[
                SampledSequence(
                    tokens=tokens[n],
                    logprobs=logprobs[n],
                    stop_reason="stop" if stopped[n] else "length",
                )
                for n in range(num_samples)
            ]
        )

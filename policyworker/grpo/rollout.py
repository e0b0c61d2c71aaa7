"""The generation backends, one interface (`connect`, `refit`, `generate`, `close`):

- `hf`: the demo's HF inference process, refit from the worker over ZMQ before every step,
  sampling each prompt's group in one request;
- `vllm`: the demo's vLLM engine, refit through vLLM's weight-sync calls (`VllmRefit`).

Both cut each response after its first eos (with `stop_at_eos`) and return the sampler's
logprobs of the kept tokens."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from policyworker.demo.inference import InferenceProcess
from policyworker.functional.dtypes import encode_refit_info
from policyworker.functional.grpo import response_length
from policyworker.grpo.config import GenerationSection

__all__ = ["Group", "HfRollouts", "VllmBackend", "start_backend"]


def _cut(
    responses: Sequence[Sequence[int]],
    row_logprobs: Sequence[Sequence[float]],
    *,
    prompt_len: int,
    eos_token_id: int | None,
) -> Group:
    kept, logprobs = [], []
    for tokens, lp in zip(responses, row_logprobs, strict=True):
        n = response_length(tokens, eos_token_id=eos_token_id)
        kept.append(tuple(int(t) for t in tokens[:n]))
        logprobs.append(tuple(float(x) for x in lp[prompt_len : prompt_len + n]))
    return Group(responses=tuple(kept), logprobs=tuple(logprobs))


@frozen(kw_only=True)
class Group:
    """The responses of one prompt, each cut at its first eos, with the sampler's logprobs."""

    responses: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]


class HfRollouts:
    """An inference process holding its own copy of the model of `model_dir`."""

    def __init__(self, model_dir: str, section: GenerationSection, *, device: str, dtype_name: str):
        self.section = section
        self.process = InferenceProcess(
            model_dir, device=device, dtype_name=dtype_name, timeout_s=section.timeout_s
        )

    def connect(self, worker: Any) -> None:
        """Point the inference process at the worker's refit stream."""
        info = worker.prepare_refit_info()
        self.process.wait_ready()
        self.process.call(
            "connect",
            address=worker.get_zmq_address(),
            refit_info=encode_refit_info(info),
            timeout_s=self.section.timeout_s,
        )

    def refit(self, worker: Any) -> float:
        """Send the worker's weights; returns the seconds it took."""
        start = time.perf_counter()
        worker.offload_before_refit()
        self.process.request("refit")
        worker.stream_weights_via_ipc_zmq(timeout_s=self.section.timeout_s)
        self.process.result("refit")
        worker.offload_after_refit()
        return time.perf_counter() - start

    def generate(
        self, prompt: Sequence[int], *, count: int, seed: int, eos_token_id: int | None
    ) -> Group:
        """`count` responses to `prompt`, sampled from `seed` (same seed, same responses)."""
        reply = self.process.call(
            "generate",
            prompts=[list(prompt)] * count,
            response_len=self.section.max_new_tokens,
            seed=seed,
            score_micro_batch_size=count,
            temperature=self.section.temperature,
        )
        return _cut(
            reply["responses"],
            reply["generation_logprobs"],
            prompt_len=len(prompt),
            eos_token_id=eos_token_id if self.section.stop_at_eos else None,
        )

    def close(self) -> None:
        self.process.close()


class VllmBackend:
    """A vLLM engine (vLLM's default CPU layout, or a GPU) holding the model of `model_dir`."""

    def __init__(
        self,
        model_dir: str,
        section: GenerationSection,
        *,
        dtype_name: str,
        max_model_len: int,
        seed: int,
    ) -> None:
        from policyworker.demo.vllm_rollouts import VllmRollouts

        self.section = section
        self.engine = VllmRollouts(
            model_dir,
            dtype_name=dtype_name,
            max_model_len=max_model_len,
            seed=seed,
            timeout_s=section.timeout_s,
        )

    def connect(self, worker: Any) -> None:
        self.engine.connect(worker)

    def refit(self, worker: Any) -> float:
        start = time.perf_counter()
        self.engine.refit()  # vLLM's weight-sync calls around the worker's stream
        return time.perf_counter() - start

    def generate(
        self, prompt: Sequence[int], *, count: int, seed: int, eos_token_id: int | None
    ) -> Group:
        import torch

        rows = torch.tensor([list(prompt)] * count, dtype=torch.int64)
        responses, gen_lp = self.engine.generate(rows, self.section.max_new_tokens, seed)
        return _cut(
            responses.tolist(),
            gen_lp.tolist(),
            prompt_len=len(prompt),
            eos_token_id=eos_token_id if self.section.stop_at_eos else None,
        )

    def close(self) -> None:
        self.engine.close()


def start_backend(
    model_dir: str,
    section: GenerationSection,
    *,
    device: str,
    dtype_name: str,
    seed: int,
    max_model_len: int,
) -> HfRollouts | VllmBackend:
    """The backend `section.backend` names, started."""
    if section.backend == "vllm":
        return VllmBackend(
            model_dir, section, dtype_name=dtype_name, max_model_len=max_model_len, seed=seed
        )
    return HfRollouts(model_dir, section, device=device, dtype_name=dtype_name)

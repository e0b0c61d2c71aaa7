"""The `hf` generation backend: the demo's HF inference process, refit from the worker over
ZMQ before every step, sampling each prompt's group in one request."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from policyworker.demo.inference import InferenceProcess
from policyworker.functional.dtypes import encode_refit_info
from policyworker.functional.grpo import response_length
from policyworker.grpo.config import GenerationSection

__all__ = ["Group", "HfRollouts"]


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
        eos = eos_token_id if self.section.stop_at_eos else None
        responses, logprobs = [], []
        for tokens, lp in zip(reply["responses"], reply["generation_logprobs"], strict=True):
            n = response_length(tokens, eos_token_id=eos)
            responses.append(tuple(tokens[:n]))
            logprobs.append(tuple(lp[len(prompt) : len(prompt) + n]))
        return Group(responses=tuple(responses), logprobs=tuple(logprobs))

    def close(self) -> None:
        self.process.close()

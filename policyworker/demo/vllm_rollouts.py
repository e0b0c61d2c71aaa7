"""`policyworker demo --engine vllm`: a real vLLM engine samples every rollout.

One engine for the whole run (vLLM's default CPU layout: engine core and worker each in their own
process), built with `engine_kwargs()`; every update reaches it through vLLM's own
weight-sync calls (`VllmRefit`, backend `policyworker_zmq`), fed by the worker's
`stream_weights_via_ipc_zmq`. Each rollout returns vLLM's logprob of every sampled token (raw
logprobs: temperature 1, no top-k/top-p, so equal to the full-vocabulary log-softmax).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["VllmRollouts", "rollout_tensors", "sampling_params"]

T = TypeVar("T")

# vLLM's CPU KV cache defaults to a share of RAM (the demo's rows need a few MiB); its INFO logs
# go to stdout and would bury the step lines. Both stay overridable from the environment.
_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def _interruptible(build: Callable[[], T]) -> T:
    """`build()` on a daemon thread while this thread waits in short steps.

    vLLM's start-up waits for its engine process in one long ZMQ poll; a Ctrl-C that the kernel
    hands to another thread of this process cannot end that poll, so the interrupt would wait
    out vLLM's engine-ready timeout (minutes). A join with a timeout returns to Python often,
    where the KeyboardInterrupt is raised; the caller then stops the engine's processes.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # re-raised on the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=run, name="policyworker-demo-vllm-start", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in box:
        raise box["error"]
    return box["value"]


def sampling_params(n: int, response_len: int, seed: int) -> list[Any]:
    """One vLLM ``SamplingParams`` per row: exactly ``response_len`` tokens at temperature 1
    with the sampled token's raw logprob. Row i samples with seed ``seed * 1_000 + i``: the
    repeated prompts of a GRPO group must not share a random stream (equal seeds give equal
    answers and zero advantages)."""
    # vLLM is an optional extra, absent from the lint environment.
    from vllm import SamplingParams  # pyright: ignore[reportMissingImports]

    return [
        SamplingParams(
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=response_len,
            min_tokens=response_len,
            ignore_eos=True,
            logprobs=0,
            seed=seed * 1_000 + i,
            detokenize=False,
        )
        for i in range(n)
    ]


def rollout_tensors(
    outs: list[Any], *, prompt_len: int, response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, Lr] sampled tokens, [N, Lp + Lr] fp32 logprobs of them, 0 on prompt columns) from
    vLLM's request outputs, one per row in row order."""
    n = len(outs)
    responses = torch.zeros(n, response_len, dtype=torch.int64)
    gen_lp = torch.zeros(n, prompt_len + response_len, dtype=torch.float32)
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        if len(tokens) != response_len:
            msg = f"vLLM returned {len(tokens)} tokens for row {i}, asked for {response_len}"
            raise RuntimeError(msg)
        responses[i] = torch.tensor(tokens)
        steps = completion.logprobs or []
        if len(steps) != len(tokens) or any(step is None for step in steps):
            msg = f"vLLM returned no logprobs for row {i}; sample with logprobs=0"
            raise RuntimeError(msg)
        gen_lp[i, prompt_len:] = torch.tensor(
            [step[t].logprob for step, t in zip(steps, tokens, strict=True) if step is not None]
        )
    return responses, gen_lp


class VllmRollouts:
    """The demo's vLLM engine: `connect(worker)`, then `refit()` / `generate()` per step."""

    def __init__(
        self, model_dir: str, *, dtype_name: str, max_model_len: int, seed: int, timeout_s: float
    ) -> None:
        from policyworker.shell.engines.vllm import engine_kwargs, require_vllm
        from policyworker.shell.engines.vllm_logs import silence_expected_vllm_noise

        require_vllm()
        silence_expected_vllm_noise()
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # vLLM is an optional extra, absent from the lint environment.
        from vllm import LLM  # pyright: ignore[reportMissingImports]

        started = time.perf_counter()
        self.llm = _interruptible(
            lambda: LLM(
                model=model_dir,
                # vLLM types dtype as a Literal of names; ours is one of them ("float32", ...).
                dtype=cast(Any, dtype_name),
                enforce_eager=True,
                max_model_len=max_model_len,
                skip_tokenizer_init=True,
                seed=seed,
                **engine_kwargs(),
            )
        )
        self.start_s = time.perf_counter() - started
        self.timeout_s = timeout_s
        self._refit: Any = None

    def connect(self, worker: Any) -> None:
        from policyworker.shell.engines.vllm import VllmRefit

        self._refit = VllmRefit(self.llm, worker, timeout_s=self.timeout_s)

    def refit(self) -> dict[str, Any]:
        if self._refit is None:
            raise RuntimeError("refit before connect; call connect(worker) first")
        return self._refit.refit()

    def generate(
        self, prompts_NL: torch.Tensor, response_len: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, Lr] sampled tokens, [N, Lp + Lr] fp32 logprobs of them, 0 on prompt columns).

        Row i samples with seed `seed * 1_000 + i`: the repeated prompts of a GRPO group must
        not share a random stream (equal seeds give equal answers and zero advantages).
        """
        params = sampling_params(prompts_NL.shape[0], response_len, seed)
        outs = self.llm.generate(
            [{"prompt_token_ids": row} for row in prompts_NL.tolist()], params, use_tqdm=False
        )
        return rollout_tensors(outs, prompt_len=prompts_NL.shape[1], response_len=response_len)

    def close(self) -> None:
        from policyworker.shell.engines.vllm_logs import expected_vllm_shutdown

        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            with expected_vllm_shutdown():
                core.shutdown()

"""`policyworker demo --engine vllm --async`: a real vLLM ``AsyncLLM`` keeps generating while
each refit streams into its worker's staging; the swap runs between two engine steps.

The engine core steps in its own process; this process drives the ``AsyncLLM`` from an asyncio
loop on a daemon thread (`EngineLoop`), so the trainer's thread can stream the weights while the
step's requests decode. Per step (`VllmInflightRollouts.rollout`):

1. submit every row; wait until each has sampled its first token (all are running);
2. stream the trainer's current weights into staging (generation goes on meanwhile);
3. swap between two engine steps with the scheduler frozen, and preempt the running requests
   so their KV cache is recomputed under the new version (``aswap(recompute_kv=True)``): every
   token is then exactly its version's, which the demo's parity check compares; the swap's
   per-request counts say where each running request's tokens turned to the new version (a
   request absent from them had finished). The stall is that freeze, timed here: the swap and
   three engine rpcs, not the transfer;
4. gather the outputs; each token carries the trainer's ``policy_version`` of its weights.

`connect` makes one refit before step 1, so the engine serves exactly the trainer's weights
from the first token on, whatever it loaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from policyworker.demo.vllm_rollouts import (
    _ENV_DEFAULTS,
    _interruptible,
    rollout_tensors,
    sampling_params,
)
from policyworker.functional.staleness import token_versions

__all__ = ["EngineLoop", "VllmInflightRollouts", "build_async_llm"]

T = TypeVar("T")


class EngineLoop:
    """An asyncio loop on a daemon thread; ``run`` / ``submit`` its coroutines from others.

    An ``AsyncLLM`` binds its output handler to the loop that first runs it: build it and use it
    on one loop (``run(build_async_llm(...))``) for its whole life.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="policyworker-engine-loop", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float) -> T:
        """The coroutine's result; TimeoutError (the coroutine cancelled) after ``timeout_s``."""
        future = self.submit(coro)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def build_async_llm(**engine_args: Any) -> Any:
    """An ``AsyncLLM`` built on the running loop (its output handler starts there) with both
    policyworker refit paths enabled; ``engine_args`` are ``AsyncEngineArgs``'."""
    # vLLM is an optional extra, absent from the lint environment.
    from vllm import AsyncEngineArgs  # pyright: ignore[reportMissingImports]
    from vllm.v1.engine.async_llm import AsyncLLM  # pyright: ignore[reportMissingImports]

    from policyworker.shell.engines.vllm import engine_kwargs

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args, **engine_kwargs()))


class VllmInflightRollouts:
    """The demo's in-flight vLLM engine: ``connect(worker)``, then ``rollout(...)`` per step.

    ``owns_engine``: ``close()`` also shuts the engine and its loop down (tests that share one
    engine pass False).
    """

    def __init__(
        self, llm: Any, loop: EngineLoop, *, timeout_s: float, owns_engine: bool = True
    ) -> None:
        self.llm, self.loop, self.timeout_s, self.owns_engine = llm, loop, timeout_s, owns_engine
        self.start_s = 0.0
        self._refit: Any = None
        self._policy_of: dict[int, int] = {}  # refit version -> the trainer's policy_version
        self._step = 0

    @classmethod
    def start(
        cls, model_dir: str, *, dtype_name: str, max_model_len: int, seed: int, timeout_s: float
    ) -> VllmInflightRollouts:
        """Start an ``AsyncLLM`` on ``model_dir`` (engine core in its own process)."""
        from policyworker.shell.engines.vllm import require_vllm
        from policyworker.shell.engines.vllm_logs import silence_expected_vllm_noise

        require_vllm()
        silence_expected_vllm_noise()
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        started = time.perf_counter()
        loop = EngineLoop()
        args = dict(
            model=model_dir,
            dtype=dtype_name,
            enforce_eager=True,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,
            seed=seed,
        )
        llm = _interruptible(lambda: loop.run(build_async_llm(**args), timeout_s=900.0))
        rollouts = cls(llm, loop, timeout_s=timeout_s)
        rollouts.start_s = time.perf_counter() - started
        return rollouts

    def connect(self, worker: Any) -> None:
        """Serve ``worker``'s refits in flight, and make the first one now (before any request)."""
        from policyworker.shell.engines.vllm_inflight import VllmInflightRefit

        self._refit = VllmInflightRefit(self.llm, worker, timeout_s=self.timeout_s, connect=False)
        self.loop.run(self._refit.aconnect(), timeout_s=self.timeout_s)
        version = worker.policy_version
        self._refit.stage()
        reply = self.loop.run(self._refit.aswap(), timeout_s=self.timeout_s)
        self._check(reply)
        self._policy_of[self._refit.version] = version

    def rollout(
        self, worker: Any, prompts_NL: torch.Tensor, response_len: int, seed: int
    ) -> tuple[dict[str, Any], float]:
        """One step's rollouts sampled while ``worker``'s current weights stream in flight: the
        rollout (responses, generation logprobs, ``generation_versions`` as the trainer's policy
        versions, ``stall_ms``: how long the scheduler was frozen, seen from here) and the
        stream's milliseconds."""
        if self._refit is None:
            raise RuntimeError("rollout before connect; call connect(worker) first")
        self._step += 1
        n, prompt_len = prompts_NL.shape
        ids = [f"s{self._step}-r{i}" for i in range(n)]
        added = self._refit.version
        started = threading.Event()
        params = sampling_params(n, response_len, seed)
        generation = self.loop.submit(self._generate(prompts_NL.tolist(), params, ids, started))
        if not started.wait(timeout=self.timeout_s):
            generation.cancel()
            raise TimeoutError(f"vLLM sampled no first token of every row in {self.timeout_s} s")
        version = worker.policy_version
        t0 = time.perf_counter()
        self._refit.stage()  # the engine keeps decoding meanwhile
        refit_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        reply = self.loop.run(self._refit.aswap(recompute_kv=True), timeout_s=self.timeout_s)
        stall_ms = (time.perf_counter() - t0) * 1e3
        self._check(reply)
        self._policy_of[self._refit.version] = version
        outs = generation.result(timeout=self.timeout_s)
        responses, gen_lp = rollout_tensors(outs, prompt_len=prompt_len, response_len=response_len)
        running = self._refit.running_counts(reply)
        versions = torch.empty(n, prompt_len + response_len, dtype=torch.int64)
        for i, rid in enumerate(ids):
            # every row had started: one absent from the swap's counts had finished before it
            swaps = [(running[rid], self._refit.version)] if rid in running else []
            tags = token_versions(response_len, swaps, added)
            policy = [self._policy_of[tag] for tag in tags]
            versions[i, :prompt_len] = policy[0]
            versions[i, prompt_len:] = torch.tensor(policy)
        rollout = {
            "prompts": prompts_NL.tolist(),
            "responses": responses.tolist(),
            "generation_logprobs": gen_lp.tolist(),
            "generation_versions": versions,
            "stall_ms": stall_ms,
        }
        return rollout, refit_ms

    async def _generate(
        self, prompts: list[list[int]], params: list[Any], ids: list[str], started: Any
    ) -> list[Any]:
        remaining = set(ids)

        async def one(prompt: list[int], param: Any, rid: str) -> Any:
            final = None
            async for out in self.llm.generate({"prompt_token_ids": prompt}, param, rid):
                final = out
                remaining.discard(rid)
                if not remaining:
                    started.set()
            return final

        try:
            return list(
                await asyncio.gather(
                    *(one(p, s, r) for p, s, r in zip(prompts, params, ids, strict=True))
                )
            )
        finally:
            started.set()  # also on failure: the caller then reads the error from the future

    @staticmethod
    def _check(reply: dict[str, Any]) -> None:
        if reply["swapped"] is None or reply["failures"]:
            msg = f"the in-flight refit did not reach vLLM (worker reply {reply}); see its log"
            raise RuntimeError(msg)

    def close(self) -> None:
        from policyworker.shell.engines.vllm_logs import expected_vllm_shutdown

        if self._refit is not None:
            try:
                self.loop.run(self._refit.aclose(), timeout_s=self.timeout_s)
            finally:
                self._refit = None
        if self.owns_engine:
            with expected_vllm_shutdown():
                self.llm.shutdown()
            self.loop.close()

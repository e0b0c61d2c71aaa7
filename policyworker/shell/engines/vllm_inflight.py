"""Refits in flight into a vLLM engine, trainer side: ``VllmInflightRefit``.

The engine's worker serves the trainer's refits on a background thread into staging
(``policyworker_connect_inflight``, see ``vllm_worker.py``) while the engine keeps scheduling and
decoding; ``stage()`` streams one version, ``swap()`` is one ``collective_rpc`` that vLLM runs
between two engine steps and makes the newest staged version live: on CPU by exchanging the live
weights with a shadow copy the version was loaded into during ``stage()`` (``vllm_shadow.py``),
elsewhere by loading it then through vLLM's layerwise reload. Running requests keep their KV
cache (computed by the previous version) by default; ``swap(recompute_kv=True)`` preempts them
so their cache is recomputed under the new version.

vLLM's prefix cache outlives a swap that keeps the KV cache: a request added later whose prompt
shares blocks cached under an earlier version (a system prompt, a GRPO group's prompt) would
reuse that version's KV. ``prompt(token_ids)`` salts the request's cache by connection and
serving version, so it computes its prompt under the weights that serve it;
``swap(recompute_kv=True)`` clears the prefix cache instead.

Per-token versions: each swap reports how many output tokens every running request had sampled
before it; ``token_versions(request_id, n)`` turns those counts into the version of each of the
request's ``n`` output tokens (``functional.staleness.token_versions``). Versions count the
refits this connection staged (0: the weights the engine served when it connected).

Works with ``LLM`` (its engine core in the trainer's process, stepped by the caller) and with
``AsyncLLM`` (``connect=False``, then ``aconnect`` / ``aswap`` / ``aclose``): its engine core
keeps stepping in its own process and runs the swap between two steps.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from policyworker.functional.staleness import token_versions

__all__ = ["VllmInflightRefit"]


class VllmInflightRefit:
    """Connects ``llm`` (built with ``engine_kwargs()``) to ``sender`` for refits in flight."""

    def __init__(
        self, llm: Any, sender: Any, *, timeout_s: float = 120.0, connect: bool = True
    ) -> None:
        if not timeout_s > 0:
            msg = f"timeout_s {timeout_s} must be > 0 seconds; every wait of a refit is bounded"
            raise ValueError(msg)
        from policyworker.shell.engines.vllm import encode_refit_info, require_vllm

        require_vllm()
        self.llm, self.sender, self.timeout_s = llm, sender, timeout_s
        self.version = 0
        self._salt = uuid.uuid4().hex  # cached blocks of another connection's versions differ
        self._swaps: list[tuple[dict[str, int], int]] = []  # (output tokens per request, version)
        self._init = {
            "address": sender.get_zmq_address(),
            "refit_info": encode_refit_info(sender.prepare_refit_info()),
            "timeout_s": timeout_s,
        }
        if connect:  # an AsyncLLM: connect=False, then `await aconnect()`
            llm.collective_rpc("policyworker_connect_inflight", args=(self._init,))

    async def aconnect(self) -> None:
        """``AsyncLLM``: connect the worker (the constructor did not, with connect=False)."""
        await self.llm.collective_rpc("policyworker_connect_inflight", args=(self._init,))

    def prompt(self, token_ids: Sequence[int]) -> dict[str, Any]:
        """A vLLM token prompt whose prefix-cache blocks belong to the serving version
        (``cache_salt``): after a swap that kept the KV cache it does not reuse prompt blocks an
        earlier version computed."""
        return {
            "prompt_token_ids": list(token_ids),
            "cache_salt": f"policyworker-{self._salt}-v{self.version}",
        }

    def stage(self, **stream_kwargs: Any) -> dict[str, Any]:
        """Stream the sender's current weights into the engine's staging (the engine keeps
        generating meanwhile, if something steps it); the receiver's report."""
        return self.sender.stream_weights_via_ipc_zmq(timeout_s=self.timeout_s, **stream_kwargs)

    def swap(self, *, recompute_kv: bool = False) -> dict[str, Any]:
        """Make the newest staged version serve from the next engine step; the worker's reply
        (``swapped``: None when nothing new was staged, else its version and seconds;
        ``failures``: refits that failed midway, none of which changed the serving weights)."""
        reply = self._swapped(self.llm.collective_rpc("policyworker_swap")[0])
        if reply["swapped"] is not None and recompute_kv:
            self.llm.reset_prefix_cache(reset_running_requests=True)
        return reply

    async def aswap(self, *, recompute_kv: bool = False) -> dict[str, Any]:
        """``swap`` on an ``AsyncLLM`` (its engine core runs the rpc between two steps).

        With ``recompute_kv`` the scheduler is frozen (``pause_scheduler(mode="keep")``, no
        request aborted or drained) around the swap and the preemption, so no step runs
        between them: every token after the swap is the new version over a recomputed cache.
        The freeze lasts the swap and three more engine rpcs, not the transfer."""
        if not recompute_kv:
            return self._swapped((await self.llm.collective_rpc("policyworker_swap"))[0])
        # AsyncLLM.pause_generation would add a 20 ms sleep meant for output ordering only
        core = self.llm.engine_core
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
        try:
            reply = self._swapped((await self.llm.collective_rpc("policyworker_swap"))[0])
            if reply["swapped"] is not None:
                await self.llm.reset_prefix_cache(reset_running_requests=True)
        finally:
            await core.resume_scheduler_async()
        return reply

    def _swapped(self, reply: dict[str, Any]) -> dict[str, Any]:
        if reply["swapped"] is not None:
            self.version = reply["version"]
            self._swaps.append((_by_request(reply["output_tokens"]), self.version))
        return reply

    @staticmethod
    def running_counts(reply: dict[str, Any]) -> dict[str, int]:
        """{the caller's request id: output tokens sampled before the swap} of a swap's reply,
        for the requests running at the swap (absent: finished before it or not yet
        scheduled)."""
        return _by_request(reply["output_tokens"])

    def token_versions(
        self, request_id: str, num_tokens: int, *, added: int, finished: int
    ) -> list[int]:
        """The version that sampled each of request ``request_id``'s ``num_tokens`` output
        tokens. ``added`` and ``finished`` are ``self.version`` read when the request was added
        and when its final output arrived: only the swaps between them touched it. At such a
        swap the request was running (its count says where the swap fell) or still waiting to
        be scheduled (all its tokens came after). A request the engine preempted on its own
        and that was waiting again at a swap is outside what the counts can tell."""
        swaps: list[tuple[int, int]] = []
        initial = added
        for counts, version in self._swaps:
            if not added < version <= finished:
                continue
            if request_id in counts:
                swaps.append((counts[request_id], version))
            elif not swaps:  # not scheduled yet: its first token came after this swap
                initial = version
        return token_versions(num_tokens, swaps, initial)

    def close(self) -> None:
        """Stop the worker's receiving thread."""
        self.llm.collective_rpc("policyworker_close")

    async def aclose(self) -> None:
        """``close`` on an ``AsyncLLM``."""
        await self.llm.collective_rpc("policyworker_close")


def _by_request(counts: dict[str, int]) -> dict[str, int]:
    """vLLM's internal request ids are ``<the caller's id>-<8 random characters>``."""
    return {rid.rsplit("-", 1)[0]: n for rid, n in counts.items()}

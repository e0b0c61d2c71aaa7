"""One staged refit from one policy rank to several colocated rollout ranks: ``stream_to_all``.

Each rollout rank has its own ``ZmqIpcSender`` (one sender streams to exactly one receiver), but
the refit is cast once: every bucket lands in one shared staging buffer (a /dev/shm file, or a
CUDA IPC allocation) that every receiver maps, and the buffer is written again only after every
receiver acknowledged its last bucket. All senders carry one refit id, so the same frames go to
every receiver. A receiver that fails (a timeout, a rejection) makes the others abort at once,
instead of leaving them waiting out their own timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from policyworker.functional.buckets import IpcBucket, TensorSpec
from policyworker.functional.wire.codec import Reply
from policyworker.shell.refit.weight_stream import RefitSource
from policyworker.shell.refit.zmq import ZmqIpcSender
from policyworker.shell.refit.zmq.sender import Exchange
from policyworker.shell.refit.zmq.staged import Owed, StagedRefit
from policyworker.shell.refit.zmq.staging import Staging, open_event

__all__ = ["FanOutExchange", "stream_to_all"]


class FanOutExchange:
    """``StagedRefit``'s exchange over several senders' exchanges: each request goes to every
    receiver, and its reply is every receiver's reply (the first returned, the others' CUDA
    consumed events waited on before the buffer is written again)."""

    def __init__(self, exchanges: Sequence[Exchange], *, device: torch.device) -> None:
        self.exchanges = list(exchanges)
        self.device = device
        self.owes = [False] * len(self.exchanges)  # a reply is owed by receiver i
        self._events: dict[tuple[int, bytes], torch.cuda.Event] = {}

    @property
    def refit(self) -> str:
        return self.exchanges[0].refit

    def send(self, frames: list[bytes], *, phase: str) -> None:
        for i, exchange in enumerate(self.exchanges):
            try:
                exchange.send(frames, phase=phase)
            except BaseException as exc:
                self._abort_others(i, exc, pending=None)
                raise
            self.owes[i] = True

    def receive(self, owed: Owed) -> Reply:
        replies = []
        for i, exchange in enumerate(self.exchanges):
            try:
                replies.append(exchange.receive(owed))
            except BaseException as exc:
                self.owes[i] = False  # a timeout rebuilt its socket; a rejection ended its refit
                self._abort_others(i, exc, pending=owed)
                raise
            self.owes[i] = False
        for i, reply in enumerate(replies[1:], start=1):
            if reply.consumed_event:  # the first one's event is the staging's own to wait on
                key = (i, reply.consumed_event)
                if key not in self._events:
                    self._events[key] = open_event(self.device, reply.consumed_event)
                torch.cuda.current_stream(self.device).wait_event(self._events[key])
        first = replies[0]
        if owed[1] != "complete":
            return first
        every = [r.report for r in replies]
        return attrs.evolve(first, report={**first.report, "receivers": every})

    def abort(self, reason: str, *, pending: Owed | None = None) -> None:
        for i, exchange in enumerate(self.exchanges):
            exchange.abort(reason, pending=pending if self.owes[i] else None)
            self.owes[i] = False

    def _abort_others(self, failed: int, exc: BaseException, *, pending: Owed | None) -> None:
        reason = f"another rollout rank of this policy rank failed: {type(exc).__name__}: {exc}"
        for i, exchange in enumerate(self.exchanges):
            if i != failed:
                with contextlib.suppress(Exception):  # best effort: the first error is raised
                    exchange.abort(reason[:4096], pending=pending if self.owes[i] else None)
                self.owes[i] = False


def stream_to_all(
    senders: Sequence[ZmqIpcSender],
    specs: Sequence[TensorSpec],
    plan: Sequence[IpcBucket],
    sources: Iterator[RefitSource],
    *,
    make_staging: Callable[[int], Staging],
    buffer_bytes: int,
    timeout_s: float,
    transport: str,
    device: torch.device,
) -> dict[str, Any]:
    """One refit to every sender's receiver, cast once; the first receiver's report with every
    receiver's under ``"receivers"``."""
    with contextlib.ExitStack() as stack:
        exchanges = [
            stack.enter_context(s.exchange("send_weights (ipc fan-out)", timeout_s=timeout_s))
            for s in senders
        ]
        for sender in senders[1:]:  # one refit id: the same frames are every receiver's
            sender.refit_id = senders[0].refit_id
        refit = StagedRefit(
            FanOutExchange(exchanges, device=device),
            specs,
            plan,
            sources,
            make_staging=make_staging,
            buffer_bytes=buffer_bytes,
            transport=transport,
            keep_staging=False,
            ping_pong=(),
        )
        return refit.run(senders[0].begin_frames(specs, transport))

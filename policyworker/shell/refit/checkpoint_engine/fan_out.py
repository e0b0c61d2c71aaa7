"""One refit from one policy rank to several colocated rollout ranks, cast once.

Each rollout rank has its own ``ZmqIpcSender`` (one sender streams to exactly one receiver). All
senders carry one refit id, and a receiver that fails (a timeout, a rejection) makes the others
abort at once, instead of leaving them waiting out their own timeout.

- ``stream_one_pass_to_all``: every receiver registered its own arena (``shell.refit.one_pass``);
  each BEGIN names its own registration and every receiver checks the manifest before any write;
  each tensor is cast once, into the first receiver's arena, and copied from there into the
  others' (no staging buffer, no copy on the receivers' side).
- ``stream_to_all``: staged; every bucket lands in one shared staging buffer (a /dev/shm file,
  or a CUDA IPC allocation) that every receiver maps, and the buffer is written again only after
  every receiver acknowledged its last bucket; the same frames go to every receiver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import IpcBucket, TensorSpec
from policyworker.functional.wire.codec import Complete, RefitRejectedError, Reply, encode
from policyworker.shell.refit.one_pass.sender import OnePassWriter
from policyworker.shell.refit.weight_stream import RefitSource
from policyworker.shell.refit.zmq import ZmqIpcSender
from policyworker.shell.refit.zmq.sender import Exchange
from policyworker.shell.refit.zmq.staged import Owed, StagedRefit
from policyworker.shell.refit.zmq.staging import Staging, open_event

__all__ = ["FanOutExchange", "staged_to_all", "stream_one_pass_to_all", "stream_to_all"]


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

    def ask_each(self, requests: Sequence[list[bytes]], *, phase: str) -> list[Reply]:
        """Send receiver ``i`` its own ``requests[i]`` (a BEGIN or a COMPLETE: ``phase``) and
        return every receiver's reply, in order (a one-pass BEGIN names each receiver's own
        registration)."""
        for i, (exchange, frames) in enumerate(zip(self.exchanges, requests, strict=True)):
            try:
                exchange.send(frames, phase=phase)
            except BaseException as exc:
                self._abort_others(i, exc, pending=None)
                raise
            self.owes[i] = True
        owed = (phase, phase, -1)
        replies = []
        for i, exchange in enumerate(self.exchanges):
            try:
                replies.append(exchange.receive(owed))
            except BaseException as exc:
                self.owes[i] = False
                self._abort_others(i, exc, pending=owed)
                raise
            self.owes[i] = False
        return replies

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


@contextlib.contextmanager
def _fan_out(
    senders: Sequence[ZmqIpcSender], *, timeout_s: float, device: torch.device
) -> Iterator[FanOutExchange]:
    """Every sender's exchange, under one refit id (the same refit on every receiver)."""
    with contextlib.ExitStack() as stack:
        exchanges = [
            stack.enter_context(s.exchange("send_weights (ipc fan-out)", timeout_s=timeout_s))
            for s in senders
        ]
        for sender in senders[1:]:
            sender.refit_id = senders[0].refit_id
        yield FanOutExchange(exchanges, device=device)


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
    """One staged refit to every sender's receiver, cast once; the first receiver's report with
    every receiver's under ``"receivers"``."""
    with _fan_out(senders, timeout_s=timeout_s, device=device) as fan:
        return staged_to_all(
            fan,
            specs,
            plan,
            sources,
            make_staging=make_staging,
            buffer_bytes=buffer_bytes,
            transport=transport,
            begin=senders[0].begin_frames(specs, transport),
        )


def staged_to_all(
    fan: FanOutExchange,
    specs: Sequence[TensorSpec],
    plan: Sequence[IpcBucket],
    sources: Iterator[RefitSource],
    *,
    make_staging: Callable[[int], Staging],
    buffer_bytes: int,
    transport: str,
    begin: list[bytes] | None,
) -> dict[str, Any]:
    """The staged refit over ``fan`` from its ``begin`` (None: every receiver ACKed a BEGIN
    already, a one-pass BEGIN none of them registered for)."""
    refit = StagedRefit(
        fan,
        specs,
        plan,
        sources,
        make_staging=make_staging,
        buffer_bytes=buffer_bytes,
        transport=transport,
        keep_staging=False,
        ping_pong=(),
    )
    return refit.run(begin)


def stream_one_pass_to_all(
    senders: Sequence[ZmqIpcSender],
    writers: Sequence[OnePassWriter],
    specs: Sequence[TensorSpec],
    sources: Iterator[RefitSource],
    *,
    timeout_s: float,
    transport: str,
    device: torch.device,
    or_staged: Callable[[FanOutExchange], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One one-pass refit to every sender's receiver (``writers[i]`` holds receiver ``i``'s
    registration); the first receiver's report with every receiver's under ``"receivers"``.

    ``or_staged(fan)``: where no receiver registered, the staged refit their BEGINs began.
    Receivers that disagree (some registered, some not) are aborted, and ``RefitError`` names
    the fix. Any failure after the ACKs aborts every receiver: none takes a new version (an
    in-place one reports ``stale``, as the one-pass rules say).
    """
    with _fan_out(senders, timeout_s=timeout_s, device=device) as fan:
        begins = [
            s.begin_frames(specs, transport, one_pass=w.held_id, or_staged=or_staged is not None)
            for s, w in zip(senders, writers, strict=True)
        ]
        replies = fan.ask_each(begins, phase="begin")  # a rejection raises, the others aborted
        registered = [r.registration is not None for r in replies]
        if or_staged is not None and not any(registered):
            return or_staged(fan)
        try:
            if not all(registered):
                msg = (
                    f"the rollout ranks of this policy rank disagree: {registered.count(True)} "
                    f"of {len(registered)} registered for one-pass refits (an nn.Module target) "
                    "and the others did not (a load_weights callable); nothing was written. "
                    "Pass engine_kwargs one_pass=False to every member"
                )
                raise RefitError(msg)
            views = [_adopted_views(w, r, specs) for w, r in zip(writers, replies, strict=True)]
            for writer in writers[1:]:  # a CPU arena is a file: its size is checked around
                writer.check_arena()
            event = writers[0].write(specs, views[0], sources, mirrors=views[1:])
            for writer in writers[1:]:
                writer.check_arena()
        except BaseException as exc:
            fan.abort(f"{type(exc).__name__}: {exc}")
            raise
        complete = encode(Complete(0, one_pass=True, written_event=event, refit=fan.refit))
        try:
            done = fan.ask_each([complete] * len(senders), phase="complete")
        except (RefitTimeoutError, RefitRejectedError):
            for writer in writers:  # a receiver may have re-registered: ask for all of it again
                writer.close()
            raise
        return {**done[0].report, "receivers": [r.report for r in done]}


def _adopted_views(
    writer: OnePassWriter, reply: Reply, specs: Sequence[TensorSpec]
) -> list[torch.Tensor]:
    """``writer``'s views of the registration in ``reply``, checked against ``specs``."""
    try:
        writer.adopt(reply)
        return writer.views(specs)  # checked against the manifest: nothing written yet
    except BaseException:
        writer.close()  # ask for the whole registration at the next BEGIN
        raise

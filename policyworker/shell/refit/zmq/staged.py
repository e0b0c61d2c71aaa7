"""One staged refit on a sender's socket: ``StagedRefit``.

BEGIN (the manifest), then every planned bucket cast into one of two ping-pong staging buffers
and announced, then COMPLETE. Requests are pipelined: the reply owed for one request is read
(``settle``) just before the next is sent, so the receiver checks the manifest while the first
buffer is allocated and filled, and copies one bucket while the next one is cast. A failure
anywhere aborts the refit in the right order: the reply owed first (the receiver may still be
reading that buffer), then ABORT, then the staging goes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs
import torch

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import IpcBucket, TensorSpec
from policyworker.functional.wire.codec import (
    Bucket,
    Complete,
    ProtocolError,
    RefitRejectedError,
    Reply,
    encode,
)
from policyworker.shell.refit.weight_stream import RefitSource
from policyworker.shell.refit.zmq.staging import (
    Staging,
    bucket_slots,
    cached_copy_groups,
    grouped_copy_,
    run_copy_groups,
)

__all__ = ["Owed", "RefitExchange", "StagedRefit"]

# A request whose reply is owed: (phase for messages, kind, bucket sequence or -1).
Owed = tuple[str, str, int]


class RefitExchange(Protocol):
    """One refit's requests and replies on a sender's socket (``sender.Exchange``)."""

    @property
    def refit(self) -> str: ...
    def send(self, frames: list[bytes], *, phase: str) -> None: ...
    def receive(self, owed: Owed) -> Reply: ...
    def abort(self, reason: str, *, pending: Owed | None = None) -> None: ...


class StagedRefit:
    """The state of one staged refit: the ping-pong pair, the request whose reply is owed and
    the buffer its bucket is in, and whether BEGIN went out (an abort is owed then).

    ``ping_pong`` starts with the buffers a ``keep_staging`` refit left (their slot caches valid
    for ``plan``); ``kept`` holds the pair this refit keeps once it succeeded. ``plain``: the
    stream's ``RefitStream.plain``; each bucket's tensors are then taken from it, and the copy
    groups of a kept buffer's bucket reused while they are the same tensor objects.
    """

    def __init__(
        self,
        exchange: RefitExchange,
        specs: Sequence[TensorSpec],
        plan: Sequence[IpcBucket],
        sources: Iterator[RefitSource],
        *,
        make_staging: Callable[[int], Staging],
        buffer_bytes: int,
        transport: str,
        keep_staging: bool,
        ping_pong: Sequence[Staging],
        plain: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.exchange, self.specs, self.plan, self.sources = exchange, specs, plan, sources
        # the stream's whole live tensors (``RefitStream.plain``): read instead of ``sources``
        self.plain = plain
        self.make_staging, self.buffer_bytes = make_staging, buffer_bytes
        self.transport, self.keep_staging = transport, keep_staging
        self.ping_pong: list[Staging | None] = [*ping_pong, None, None][:2]
        self.kept: list[Staging] = []
        # every staging tensor this refit made or reused (the sender reports the live bytes)
        self.staging_refs: list[weakref.ref[torch.Tensor]] = [
            weakref.ref(s.tensor) for s in ping_pong if s.tensor is not None
        ]
        self.pending: Owed | None = None  # the request whose reply is still owed
        self.pending_staging: Staging | None = None  # the buffer that request's bucket is in
        self.begun = False

    def run(self, begin: list[bytes] | None) -> dict[str, Any]:
        """The refit, from its ``begin`` frames (None: the receiver already ACKed its BEGIN);
        the receiver's report."""
        try:
            if begin is not None:
                self.request(begin, ("begin", "begin", -1))
                # its reply is settled by the first bucket's request: the receiver checks the
                # manifest while the first buffer is allocated and filled
            self.begun = True
            turn = 0
            for seq, bucket in enumerate(self.plan):
                items = self.take(bucket)
                if bucket.oversized:
                    self.send_alone(seq, bucket, items)
                else:
                    self.send_in_turn(seq, bucket, items, turn % 2)
                    turn += 1
                del items
            self.settle()
            self.finish_staging()
            self.request(
                encode(Complete(len(self.plan), refit=self.exchange.refit)),
                ("complete", "complete", -1),
            )
            reply = self.settle()
            self.begun = False
            assert reply is not None
            for staging in self.kept:
                staging.forget_consumed()
            return reply.report
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            if self.transport == "cuda":
                torch.cuda.ipc_collect()

    def request(self, frames: list[bytes], owed: Owed, staging: Staging | None = None) -> None:
        """Settle the reply owed, then send ``frames``, whose reply is owed from now."""
        self.settle()
        self.exchange.send(frames, phase=owed[0])
        self.pending, self.pending_staging = owed, staging

    def settle(self) -> Reply | None:
        """Read the reply owed (if any); its bucket's buffer may be written again after it."""
        if self.pending is None:
            return None
        owed, staging = self.pending, self.pending_staging
        self.pending = self.pending_staging = None
        reply = self.exchange.receive(owed)
        if staging is not None:
            staging.note_consumed(reply.consumed_event)
        return reply

    def take(self, bucket: IpcBucket) -> list[torch.Tensor]:
        """The bucket's source tensors (uncast), checked against the manifest when they come
        from the stream's sources (``plain`` ones have their specs' shapes by contract)."""
        if self.plain is not None:
            plain = self.plain
            return [plain[i] for i in bucket.indices]
        items = [next(self.sources) for _ in bucket.indices]
        for i, item in zip(bucket.indices, items, strict=True):
            want = self.specs[i]
            if (
                item.name != want.name
                or item.dtype != want.dtype
                or item.tensor.shape != want.shape
            ):
                msg = (
                    f"internal: the params stream sent {item.spec} where prepare_refit_info "
                    f"said {want}"
                )
                raise RefitError(msg)
        return [item.tensor for item in items]

    def fill(
        self, staging: Staging, key: Any, slots: list[torch.Tensor], items: list[torch.Tensor]
    ) -> None:
        """Cast ``items`` into their ``slots`` in grouped launches; with ``plain`` sources,
        under ``no_grad`` (they are live parameters) and, in a kept buffer (``key`` not None),
        with the groups of the last refit while they are the same tensors."""
        if self.plain is None:
            grouped_copy_(slots, items, non_blocking=True)
            return
        with torch.no_grad():
            if key is None:
                grouped_copy_(slots, items, non_blocking=True)
            else:
                groups = cached_copy_groups(staging.cache, key, slots, items)
                run_copy_groups(groups, non_blocking=True)

    def send_alone(self, seq: int, bucket: IpcBucket, items: list[torch.Tensor]) -> None:
        """An oversized bucket in a buffer of its own, freed once the receiver read it."""
        self.settle()  # the ping-pong buffer in flight is free; now send this one alone
        alone = self.new_staging(bucket.used_bytes)
        try:
            slots, frames = self.prepared(alone, seq, bucket, keep=False)
            self.fill(alone, None, slots, items)
            del slots
            alone.mark_filled()
            self.request(frames, (f"bucket {seq} (oversized)", "bucket", seq), alone)
            self.settle()
            alone.wait_for_reader()  # the allocator may hand its block out again
        finally:
            alone.close()

    def send_in_turn(
        self, seq: int, bucket: IpcBucket, items: list[torch.Tensor], slot: int
    ) -> None:
        """A bucket in ping-pong buffer ``slot``, cast once the receiver's reads of that
        buffer's last bucket are done; its reply is settled by the next request."""
        if self.ping_pong[0] is None and self.ping_pong[1] is None:
            self.new_ping_pong()
        if self.ping_pong[slot] is None:
            self.ping_pong[slot] = self.new_staging(self.buffer_bytes)
        staging = self.ping_pong[slot]
        assert staging is not None
        slots, frames = self.prepared(staging, seq, bucket, keep=self.keep_staging)
        staging.wait_for_reader()
        # queued behind the receiver's reads of this buffer's last bucket
        self.fill(staging, ("groups", seq) if self.keep_staging else None, slots, items)
        del slots
        staging.mark_filled()
        self.request(frames, (f"bucket {seq}", "bucket", seq), staging)

    def prepared(
        self, staging: Staging, seq: int, bucket: IpcBucket, *, keep: bool
    ) -> tuple[list[torch.Tensor], list[bytes]]:
        """The bucket's slot views (cached with the buffer) and its frames in this refit."""
        hit = staging.cache.get((seq, keep))
        if hit is None:
            base = staging.base  # where this half starts in the shared buffer
            message = Bucket(
                seq,
                staging.ref(keep=keep),
                bucket.indices,
                tuple(base + o for o in bucket.offsets),
                base + bucket.used_bytes,
            )
            hit = staging.cache[(seq, keep)] = (bucket_slots(staging, bucket, self.specs), message)
        slots, message = hit
        return slots, encode(attrs.evolve(message, refit=self.exchange.refit))

    def new_staging(self, nbytes: int) -> Staging:
        staging = self.make_staging(nbytes)
        assert staging.tensor is not None
        self.staging_refs.append(weakref.ref(staging.tensor))
        return staging

    def new_ping_pong(self) -> None:
        """Both buffers from one allocation when at least two buckets will use them."""
        if sum(not b.oversized for b in self.plan) < 2:
            self.ping_pong[0] = self.new_staging(self.buffer_bytes)
            return
        whole = self.make_staging(2 * self.buffer_bytes)
        self.ping_pong[:] = whole.halves(self.buffer_bytes)
        self.staging_refs.extend(
            weakref.ref(s.tensor) for s in self.ping_pong if s is not None and s.tensor is not None
        )

    def finish_staging(self) -> None:
        """Before COMPLETE: keep the pair (``keep_staging``) or free it once it was read."""
        if self.keep_staging:
            self.kept = [s for s in self.ping_pong if s is not None]
            self.ping_pong[:] = [None, None]
            return
        for staging in self.ping_pong:
            if staging is not None:
                staging.wait_for_reader()
        self.release()
        if self.transport == "cuda":
            torch.cuda.empty_cache()

    def release(self) -> None:
        for i, staging in enumerate(self.ping_pong):
            if staging is not None:
                staging.close()
                self.ping_pong[i] = None

    def fail(self, exc: BaseException) -> None:
        """After ``exc``: announce the abort if the receiver does not know yet, then free the
        staging. A timeout rebuilt the socket, a rejection already ended the receiver's refit
        and a reply to another request means the peer is not to be trusted; any other failure
        (our own) is announced so the receiver stops waiting at once. Before the staging goes:
        the receiver may still be reading the bucket whose reply is owed."""
        try:
            ended = (RefitTimeoutError, RefitRejectedError, ProtocolError)
            if self.begun and not isinstance(exc, ended):
                self.exchange.abort(f"{type(exc).__name__}: {exc}", pending=self.pending)
        finally:
            self.release()
            for staging in self.kept:
                staging.close()
            self.kept = []
            if self.transport == "cuda":
                torch.cuda.empty_cache()

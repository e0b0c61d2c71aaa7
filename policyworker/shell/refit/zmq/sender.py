"""The trainer side of a colocated ZMQ refit: ``ZmqIpcSender``.

A DEALER socket bound in a private folder (``ipc_files``) streams one refit per ``stream`` call:
BEGIN (manifest) → BUCKET* → COMPLETE, each answered by one reply, through ping-pong staging
buffers (``staged.StagedRefit`` over ``staging``). The encoded manifest is cached per specs
object and, per staging buffer, each bucket's slot views and message; with ``keep_staging`` the
buffers and caches survive the refit.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import (
    DEFAULT_ALIGNMENT,
    IpcBucket,
    TensorSpec,
)
from policyworker.functional.wire.codec import (
    MAX_HEADER_BYTES,
    Abort,
    Begin,
    ProtocolError,
    RefitRejectedError,
    Reply,
    decode_reply,
    encode,
    encode_manifest,
)
from policyworker.shell.refit.weight_stream import RefitSource
from policyworker.shell.refit.zmq.ipc_files import (
    ZmqHandles,
    check_ipc_address,
    create_locked_dir,
    remove_orphans,
    zmq_timeout_ms,
)
from policyworker.shell.refit.zmq.staged import Owed, StagedRefit
from policyworker.shell.refit.zmq.staging import CudaStaging, Staging

__all__ = ["Exchange", "ZmqIpcSender"]

log = logging.getLogger(__name__)
_ABORT_TIMEOUT_S = 2.0
_MAX_REPLY_BYTES = MAX_HEADER_BYTES  # as the decoder: a big MoE's one-pass registration is MiBs


class Exchange:
    """Requests and their replies on a sender's socket, within ``ZmqIpcSender.exchange``."""

    def __init__(self, sender: ZmqIpcSender, timeout_s: float) -> None:
        self._sender = sender
        self.timeout_s = timeout_s

    @property
    def refit(self) -> str:
        """The id of this refit: every request carries it and every reply must echo it."""
        return self._sender.refit_id

    def ask(self, frames: list[bytes], *, phase: str) -> Reply:
        """Send ``frames`` (a BEGIN or a COMPLETE: ``phase`` is "begin" or "complete") and
        return the receiver's reply to it. ``RefitTimeoutError`` when either wait passes
        ``timeout_s`` (the socket is rebuilt); ``RefitRejectedError`` naming ``phase`` and the
        receiver's reason when it refuses; ``ProtocolError`` for a reply to another request."""
        self._sender._send(frames, phase=phase, timeout_s=self.timeout_s)
        return self._sender._reply((phase, phase, -1), timeout_s=self.timeout_s)

    def send(self, frames: list[bytes], *, phase: str) -> None:
        """Send a request without waiting for its reply (``receive`` reads it later)."""
        self._sender._send(frames, phase=phase, timeout_s=self.timeout_s)

    def receive(self, owed: Owed) -> Reply:
        """The reply to the request ``owed`` (see ``ask`` for the errors)."""
        return self._sender._reply(owed, timeout_s=self.timeout_s)

    def abort(self, reason: str, *, pending: Owed | None = None) -> None:
        """Tell the receiver this refit is off (best effort), after the reply owed for
        ``pending`` if one is."""
        self._sender._abort(pending, reason, timeout_s=self.timeout_s)


class ZmqIpcSender:
    """The trainer side: a DEALER socket in a private folder; one refit per ``stream`` call."""

    def __init__(self, *, rank: int) -> None:
        self.rank = rank
        remove_orphans()  # what senders killed earlier left in /dev/shm and the temp folder
        folder, folder_fd = create_locked_dir()
        self.address = f"ipc://{folder}/rank{rank}.sock"
        # the socket (its monitor counts the receivers), the context and the folder; freed by
        # close(), or by the finalizer if this sender is dropped without it
        self._handles = ZmqHandles(folder, folder_fd)
        self._release_handles = weakref.finalize(self, self._handles.release)
        self._release_handles.atexit = False  # at exit a daemon thread may still use the socket
        self._peers = 0
        # connections that ended since the socket was bound (counted as connected_receivers()
        # reads the monitor's events)
        self.departed_receivers = 0
        # One thread at a time uses the socket (libzmq sockets are not thread-safe: two refits
        # at once aborted the process); a second thread is refused, not queued.
        self._busy = threading.RLock()
        self._staging_refs: list[weakref.ref[torch.Tensor]] = []
        self._kept: list[Staging] = []  # ping-pong buffers kept by a keep_staging refit
        self._kept_bytes = 0
        self._plan: Sequence[IpcBucket] | None = None  # the plan the staging caches were made for
        self._manifest: tuple[Sequence[TensorSpec], bytes] | None = None  # (specs object, frame)
        # the refit in progress and the last ones: a reply naming an old one is late, dropped
        self.refit_id = ""
        self._old_refit_ids: collections.deque[str] = collections.deque(maxlen=256)
        try:
            fix = (
                "set TMPDIR to a shorter folder (e.g. TMPDIR=/tmp) for the trainer process: "
                "the socket lives in a private folder there"
            )
            check_ipc_address(self.address, fix=fix)
            self._sock()  # bind now: a bad address fails here, not at the first refit
        except BaseException:
            self._teardown()
            raise

    @contextlib.contextmanager
    def _exclusive(self, call: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            msg = (
                f"refit rank {self.rank}: {call} was called while another thread is streaming a "
                "refit on this sender; refits of one worker run one at a time: wait for the "
                "other call to return, then call again"
            )
            raise RefitError(msg)
        try:
            if self._handles.context is None:
                msg = f"refit rank {self.rank}: {call} after close(); this sender is closed"
                raise RefitError(msg)
            yield
        finally:
            self._busy.release()

    @property
    def live_staging_bytes(self) -> int:
        """Bytes of staging tensors of the last stream still alive (0 once they are freed)."""
        return sum(t.numel() for t in (r() for r in self._staging_refs) if t is not None)

    @property
    def kept_staging_bytes(self) -> int:
        """Bytes of the ping-pong buffers kept for the next refit (``keep_staging=True``)."""
        return sum(s.size for s in self._kept)

    def release_staging(self) -> None:
        """Free the kept staging buffers (before an offload, or to return the memory for good)."""
        with self._exclusive("release_staging"):
            self._release_staging()

    def _release_staging(self) -> None:
        kept, self._kept, self._kept_bytes = self._kept, [], 0
        cuda = any(isinstance(s, CudaStaging) for s in kept)
        for staging in kept:
            staging.close()
        if cuda:
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()

    def _sock(self) -> zmq.Socket[Any]:
        handles = self._handles
        sock = handles.socket
        if sock is None:
            assert handles.context is not None
            # DEALER, not REQ: a late reply to an old refit can be read and dropped while the
            # reply owed is still awaited (REQ would take it as that reply)
            sock = handles.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES)
            handles.socket = sock
            sock.bind(self.address)
            handles.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            self._peers = self.departed_receivers = 0
        return sock

    def _rebuild(self) -> None:
        self._handles.close_socket()
        self._sock()

    def connected_receivers(self) -> int:
        """How many receivers are connected to this sender's address right now."""
        # the monitor reports plain ints; zmq.Event members hash equal to them
        peer_delta: dict[int, int] = {zmq.EVENT_ACCEPTED: 1, zmq.EVENT_DISCONNECTED: -1}
        while self._handles.monitor is not None:
            try:
                event = recv_monitor_message(self._handles.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            self._peers += peer_delta.get(event, 0)
            self.departed_receivers += event == zmq.EVENT_DISCONNECTED
        return self._peers

    def wait_for_receivers(self, connected: int, *, departed: int = 0, timeout_s: float) -> bool:
        """Wait until exactly ``connected`` receivers are connected and at least ``departed``
        have left since the socket was bound; False if ``timeout_s`` passes first.

        Call it before a refit when a receiver was just replaced on this address: a BEGIN sent
        before this sender's I/O thread has seen the old connection end can be queued on it and
        lost (DEALER picks connections in turn), which costs one refit timeout."""
        deadline = time.monotonic() + timeout_s
        while self.connected_receivers() != connected or self.departed_receivers < departed:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _check_one_receiver(self) -> None:
        """DEALER sends each message to the next connected peer in turn: with two receivers on one
        address each would see part of a refit. Refuse before BEGIN (a receiver that just rebuilt
        its socket is counted twice for a moment, so give disconnects a short while to arrive)."""
        deadline = time.monotonic() + 0.5
        while (count := self.connected_receivers()) > 1:
            if time.monotonic() > deadline:
                msg = (
                    f"refit rank {self.rank}: {count} receivers are connected to {self.address}; "
                    "one sender streams to exactly one receiver (each would get part of the "
                    "refit). "
                    "Close the extra receivers on this address (each engine rank connects to its "
                    "own trainer rank's get_zmq_address())"
                )
                raise RefitError(msg)
            time.sleep(0.01)

    def _timeout(self, phase: str, timeout_s: float) -> RefitTimeoutError:
        self._rebuild()
        msg = (
            f"refit rank {self.rank}: no progress in phase {phase!r} within {timeout_s:g} s at "
            f"{self.address}; "
            "the receiver may be dead or unresponsive. The sender rebuilt its socket: start a "
            "receiver "
            "on this address and call stream_weights_via_ipc_zmq again."
        )
        return RefitTimeoutError(msg)

    def _send(self, frames: list[bytes], *, phase: str, timeout_s: float) -> None:
        sock = self._sock()
        sock.setsockopt(zmq.SNDTIMEO, zmq_timeout_ms(timeout_s))
        try:
            # the empty frame is the envelope a REP peer expects; small frames: copying beats
            # zero-copy bookkeeping
            sock.send_multipart([b"", *frames])
        except zmq.Again:
            raise self._timeout(phase, timeout_s) from None

    def _reply(self, owed: Owed, *, timeout_s: float) -> Reply:
        """The reply to the request ``owed``; late replies to earlier refits are dropped."""
        phase = owed[0]
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._recv_reply(phase, deadline, timeout_s)
            if reply.answers(owed[1], self.refit_id, owed[2]):
                break
            if reply.refit in self._old_refit_ids:
                log.info(
                    "refit rank %d: dropped a late %r reply of an earlier refit while waiting "
                    "for %s",
                    self.rank,
                    reply.reply_to,
                    phase,
                )
                continue
            if not reply.ok and not reply.refit:  # the receiver could not read the request
                break
            self._rebuild()
            msg = (
                f"refit rank {self.rank}: the receiver's reply names request "
                f"({reply.reply_to!r}, refit {reply.refit!r:.80}, seq {reply.seq}) but the one "
                f"sent was ({owed[1]!r}, refit {self.refit_id!r}, seq {owed[2]}); the receiver "
                "does not speak this protocol (the sender rebuilt its socket): receive with "
                "HFWeightReceiver from the same policyworker version"
            )
            raise ProtocolError(msg)
        if not reply.ok:
            msg = f"refit rank {self.rank}: the receiver rejected {phase}: {reply.reason}"
            raise RefitRejectedError(msg)
        return reply

    def _recv_reply(self, phase: str, deadline: float, timeout_s: float) -> Reply:
        sock = self._sock()
        sock.setsockopt(zmq.RCVTIMEO, zmq_timeout_ms(max(deadline - time.monotonic(), 0.001)))
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            raise self._timeout(phase, timeout_s) from None
        if not frames or frames[0] != b"":
            self._rebuild()
            msg = f"refit rank {self.rank}: a reply in phase {phase!r} lacks its empty envelope"
            raise ProtocolError(msg)
        try:
            return decode_reply(frames[1:])
        except ProtocolError:
            self._rebuild()
            raise

    @contextlib.contextmanager
    def exchange(self, call: str, *, timeout_s: float) -> Iterator[Exchange]:
        """One refit's use of the socket (``stream``'s, or a protocol built outside this class:
        the one-pass refit): held exclusively (``call`` names it in the error a second thread
        gets), refused when more than one receiver is connected, and the wait for a missing
        receiver logged."""
        with self._exclusive(call):
            self._check_one_receiver()
            self._note_wait(timeout_s)
            if self.refit_id:
                self._old_refit_ids.append(self.refit_id)
            self.refit_id = secrets.token_hex(8)
            yield Exchange(self, timeout_s)

    def begin_frames(
        self,
        specs: Sequence[TensorSpec],
        transport: str,
        *,
        one_pass: str | None = None,
        or_staged: bool = False,
    ) -> list[bytes]:
        """The BEGIN of a refit of ``specs`` (``one_pass``: the registration id a one-pass
        refit holds, "" for none; None for a staged refit; ``or_staged``: a receiver that did
        not register begins a staged refit instead). The manifest is encoded once per specs
        object: a steady-state refit reuses its frame."""
        if self._manifest is None or self._manifest[0] is not specs:
            self._manifest = (specs, encode_manifest(specs))
        begin = Begin(
            self.rank,
            transport,
            DEFAULT_ALIGNMENT,
            tuple(specs),
            one_pass,
            self.refit_id,
            or_staged,
        )
        return encode(begin, manifest_frame=self._manifest[1])

    def stream(
        self,
        specs: Sequence[TensorSpec],
        plan: Sequence[IpcBucket],
        sources: Iterator[RefitSource],
        *,
        make_staging: Callable[[int], Staging],
        buffer_bytes: int,
        timeout_s: float,
        transport: str,
        keep_staging: bool = False,
        begun: Exchange | None = None,
        plain: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """One refit: BEGIN, the planned buckets through two ping-pong buffers, COMPLETE.

        Returns the receiver's report. By default the staging buffers are freed before COMPLETE
        is sent. ``keep_staging=True`` keeps the two ping-pong buffers (and their cached slot
        views and frames) for the next refit with the same ``buffer_bytes`` until
        ``release_staging`` or ``close``; the receiver then keeps its mappings too. On any
        failure every staging buffer, kept or not, is freed before this raises.

        ``begun``: the exchange of a refit whose BEGIN the receiver already answered with a
        staged ACK (a default one-pass BEGIN to a receiver that did not register); the
        buckets follow in it. ``plain``: the stream's ``RefitStream.plain`` (the tensors are read
        from it, not from ``sources``; see ``StagedRefit``).
        """
        if begun is not None:
            return self._staged(
                begun,
                specs,
                plan,
                sources,
                None,
                make_staging,
                buffer_bytes,
                transport,
                keep_staging,
                plain,
            )
        with self.exchange("stream_weights_via_ipc_zmq", timeout_s=timeout_s) as exchange:
            begin = self.begin_frames(specs, transport)
            return self._staged(
                exchange,
                specs,
                plan,
                sources,
                begin,
                make_staging,
                buffer_bytes,
                transport,
                keep_staging,
                plain,
            )

    def _staged(
        self,
        exchange: Exchange,
        specs: Sequence[TensorSpec],
        plan: Sequence[IpcBucket],
        sources: Iterator[RefitSource],
        begin: list[bytes] | None,
        make_staging: Callable[[int], Staging],
        buffer_bytes: int,
        transport: str,
        keep_staging: bool,
        plain: Sequence[torch.Tensor] | None,
    ) -> dict[str, Any]:
        refit = StagedRefit(
            exchange,
            specs,
            plan,
            sources,
            make_staging=make_staging,
            buffer_bytes=buffer_bytes,
            transport=transport,
            keep_staging=keep_staging,
            ping_pong=self._take_kept(plan, buffer_bytes, transport),
            plain=plain,
        )
        self._staging_refs = refit.staging_refs
        report = refit.run(begin)
        self._kept, self._kept_bytes = refit.kept, buffer_bytes if refit.kept else 0
        return report

    def _take_kept(
        self, plan: Sequence[IpcBucket], buffer_bytes: int, transport: str
    ) -> list[Staging]:
        """The buffers a ``keep_staging`` refit left, if this refit can use them (same size
        and kind, intact), with their caches cleared for a new plan; the rest are freed."""
        if any(not s.intact() for s in self._kept):  # e.g. a kept file truncated meanwhile
            self._release_staging()
        if self._kept and (
            self._kept_bytes != buffer_bytes
            or not all(isinstance(s, CudaStaging) == (transport == "cuda") for s in self._kept)
        ):
            self._release_staging()
        if plan is not self._plan:  # cached slot views / frames belong to one plan object
            for staging in self._kept:
                staging.cache.clear()
            self._plan = plan
        kept, self._kept, self._kept_bytes = self._kept, [], 0
        return kept

    def _note_wait(self, timeout_s: float) -> None:
        """Log where the sender waits when no receiver is connected yet (DEALER is not writable)."""
        if not self._sock().poll(0, zmq.POLLOUT):
            log.info(
                "refit rank %d: waiting up to %g s for a receiver at %s (build "
                "HFWeightReceiver(address=...) there and call receive())",
                self.rank,
                timeout_s,
                self.address,
            )

    def _abort(self, pending: Owed | None, reason: str, *, timeout_s: float) -> None:
        """Tell the receiver the refit is off (best effort; rebuild the socket on failure).

        The reply owed for ``pending`` is awaited first, as long as any reply (the receiver is
        still reading that bucket). A rejection there means the receiver already ended its refit:
        no ABORT is sent, so none can wait in its queue for the next refit. The ABORT's own reply
        gets a short wait: a receiver that is slow to roll back still handles it in this refit.
        """
        try:
            if pending is not None:
                try:
                    self._reply(pending, timeout_s=timeout_s)
                except RefitRejectedError:
                    return
            abort = encode(Abort(reason[:4096], self.refit_id))
            self._send(abort, phase="abort", timeout_s=_ABORT_TIMEOUT_S)
            self._reply(("abort", "abort", -1), timeout_s=_ABORT_TIMEOUT_S)
        except (zmq.ZMQError, RefitError):
            self._rebuild()

    def close(self) -> None:
        """Free the staging, the socket and its folder (idempotent; refused while another thread
        streams a refit on this sender)."""
        if self._handles.context is None:
            return
        with self._exclusive("close"):
            self._release_staging()
            self._teardown()

    def _teardown(self) -> None:
        """Close every socket, then the context (which cannot block: no socket is left open),
        then remove the folder and drop its lock."""
        self._release_handles()

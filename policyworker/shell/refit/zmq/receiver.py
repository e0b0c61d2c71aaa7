"""The inference side's socket of a colocated ZMQ refit: ``ZmqIpcReceiver``.

A REP socket connected to the sender's address; ``serve`` hands every request to a
``RefitServer`` and sends its reply, every wait bounded by ``timeout_s``, and ``close`` works
from any thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.shell.refit.zmq.ipc_files import ZmqHandles, check_ipc_address, zmq_timeout_ms
from policyworker.shell.refit.zmq.server import RefitServer

__all__ = ["ReceiverClosedError", "ZmqIpcReceiver", "expected_from_refit_info"]

_POLL_SLICE_MS = 50  # a waiting receive() notices close() from another thread this fast
_CLOSE_WAIT_S = 2.0  # how long close() waits for a receive() in another thread to let go


class ReceiverClosedError(RefitError):
    """``close()`` was called (maybe from another thread) while ``receive()`` waited."""


class ZmqIpcReceiver:
    """The inference side's REP socket: serves one refit per ``serve`` call, every wait bounded.

    ``max_message_bytes`` caps every frame (ZMQ drops a peer that sends a larger one before
    reading it, so a bogus 1 GiB frame costs nothing). ``close()`` may be called from any thread:
    a ``serve`` waiting in another thread raises ``ReceiverClosedError`` within ~50 ms (or when
    its current bucket is applied), and only the thread inside ``serve`` touches the socket.
    """

    def __init__(
        self, address: str, *, timeout_s: float, max_message_bytes: int | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._serving = threading.Lock()  # held by the thread inside serve()
        self._closed = threading.Event()
        self._handles = ZmqHandles()
        # frees the socket and context if this receiver is dropped without close()
        self._release_handles = weakref.finalize(self, self._handles.release)
        self._release_handles.atexit = False  # at exit a daemon thread may still poll the socket
        self._dropped = False  # ZMQ dropped the connection for good (a frame over the cap)
        try:
            check_ipc_address(address, fix="the sender's get_zmq_address() is always short enough")
            self._connect()
        except BaseException:
            self._release()  # the socket and context go with the failed construction
            raise

    def _connect(self) -> None:
        assert self._handles.context is not None
        sock = self._handles.context.socket(zmq.REP)
        self._handles.socket = sock
        sock.setsockopt(zmq.LINGER, 0)
        if self._max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        self._handles.monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        self._dropped = False
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            msg = (
                f"refit receiver cannot connect to {self.address!r}: {exc}; pass the "
                "sender's get_zmq_address()"
            )
            raise ValueError(msg) from None

    def _reconnect(self) -> None:
        self._handles.close_socket()
        self._connect()

    def _connection_dropped(self) -> bool:
        """True when the connection ended without a reconnect scheduled: ZMQ does not reconnect
        after dropping a peer for a frame over MAXMSGSIZE, so the socket must be rebuilt."""
        while self._handles.monitor is not None:
            try:
                event = recv_monitor_message(self._handles.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            self._dropped = event == zmq.EVENT_DISCONNECTED
        return self._dropped

    def _release(self) -> None:
        """Close the sockets, then the context (term cannot block: no socket is left open)."""
        self._release_handles()

    def serve(self, server: RefitServer) -> Any:
        """Answer messages until the refit completes (its report) or fails (``RefitError``)."""
        if not self._serving.acquire(blocking=False):
            msg = (
                f"refit receiver at {self.address}: receive() is already running in another "
                "thread; one receive() at a time per receiver"
            )
            raise RefitError(msg)
        try:
            return self._serve(server)
        finally:
            if self._closed.is_set():  # close() came while we served: the socket is ours to close
                self._release()
            self._serving.release()

    def _closed_error(self, phase: str) -> ReceiverClosedError:
        return ReceiverClosedError(
            f"refit receiver at {self.address} was closed while receive() "
            f"waited in phase {phase!r}; a refit in progress was dropped"
        )

    def _recv(self, server: RefitServer, phase: str, started: float) -> list[bytes]:
        """The next message, polling in short slices so that close() is noticed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            sock = self._handles.socket
            if self._closed.is_set() or sock is None:
                server.fail("the receiver was closed")
                raise self._closed_error(phase)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if sock.poll(min(_POLL_SLICE_MS, zmq_timeout_ms(left)), zmq.POLLIN):
                with contextlib.suppress(zmq.Again):
                    return sock.recv_multipart(zmq.NOBLOCK, copy=True)
        server.fail(f"timed out waiting for {phase}")
        if phase != "begin" or self._connection_dropped():
            # Mid-refit, the sender is gone or stuck; start clean. An idle wait keeps a live
            # connection: rebuilding it would drop a BEGIN arriving at that moment (a retry race).
            self._reconnect()
        msg = (
            f"refit receiver: no message in phase {phase!r} within {self.timeout_s:g} s at "
            f"{self.address} ({time.monotonic() - started:.1f} s into receive()); is the sender "
            "streaming?"
        )
        raise RefitTimeoutError(msg)

    def _serve(self, server: RefitServer) -> Any:
        started = time.monotonic()
        phase = "begin"
        while True:
            frames = self._recv(server, phase, started)
            reply, outcome = server.handle(frames)
            sock = self._handles.socket
            assert sock is not None
            sock.setsockopt(zmq.SNDTIMEO, zmq_timeout_ms(self.timeout_s))
            try:
                sock.send_multipart(reply)
            except zmq.Again:
                server.fail("could not send a reply")
                self._reconnect()  # a REP that owes a reply cannot receive again
                raise RefitTimeoutError(
                    f"refit receiver: could not reply at {self.address} within {self.timeout_s:g} s"
                ) from None
            if outcome.error is not None:
                raise outcome.error
            if outcome.done:
                return outcome.report
            phase = "bucket or complete" if server.in_refit else "begin"

    def close(self) -> None:
        """Close from any thread; returns within ~2 s even while another thread serves."""
        self._closed.set()
        if self._serving.acquire(timeout=_CLOSE_WAIT_S):
            try:
                self._release()
            finally:
                self._serving.release()
        # else: the serving thread is applying a bucket; it releases the socket when it returns


def expected_from_refit_info(
    refit_info: Mapping[str, Any],
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Normalise ``{name: (shape, dtype)}`` metadata (shapes as lists or Sizes)."""
    return {name: (torch.Size(shape), dtype) for name, (shape, dtype) in refit_info.items()}

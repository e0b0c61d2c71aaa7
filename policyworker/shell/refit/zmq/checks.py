"""Early answers at the edges of a ZMQ refit, so neither side waits out a timeout to learn a fact.

- ``check_receiver_address``: a receiver's address must be the ``ipc://`` path the trainer's
  ``get_zmq_address()`` returned, and a socket must exist there (the sender binds it when the
  address is handed out and removes it on ``close``/``shutdown``).
- ``answer_refusal``: a receiver that refuses ``refit_info`` at construction answers the
  sender's next BEGIN with that refusal (from a short-lived daemon thread), so the sender raises
  "the receiver rejected begin: ..." at once instead of "the receiver may be dead" after its
  whole timeout.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from typing import Any

import zmq

from policyworker.functional.wire.codec import Reply, encode

__all__ = ["answer_refusal", "cancel_refusal", "check_receiver_address", "ipc_path"]

_PREFIX = "ipc://"
_pending: dict[str, threading.Event] = {}  # address -> cancels the refusal thread serving it


def ipc_path(address: str) -> str:
    """The filesystem path of an ``ipc://`` address."""
    return address[len(_PREFIX) :]


def check_receiver_address(address: Any) -> None:
    """Raise ``ValueError`` unless ``address`` is ``ipc://<path>`` with a socket at ``<path>``."""
    if not isinstance(address, str) or not address.startswith(_PREFIX):
        msg = (
            f"address={address!r}: a refit receiver connects to the ipc:// address that the "
            f"trainer's worker.get_zmq_address() returns (a Unix socket on this machine, e.g. "
            f"'ipc:///tmp/pw-refit-abc123/rank0.sock'); pass that string unchanged"
        )
        raise ValueError(msg)
    path = ipc_path(address)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        msg = (
            f"address={address!r}: no socket exists at {path}, so no trainer is listening "
            f"there. The trainer creates it in worker.get_zmq_address() and removes it in "
            f"shutdown(); pass the address of a live worker on this machine (same user)"
        )
        raise ValueError(msg) from None
    except PermissionError:
        msg = (
            f"address={address!r}: {path} is not readable by this user; the trainer's refit "
            f"folder is private (mode 0700), so run the receiver as the trainer's user"
        )
        raise ValueError(msg) from None
    if not stat.S_ISSOCK(mode):
        msg = (
            f"address={address!r}: {path} exists but is not a socket; pass the address "
            f"returned by the trainer's worker.get_zmq_address()"
        )
        raise ValueError(msg)


def cancel_refusal(address: str) -> None:
    """Stop this process's pending refusal at ``address`` (a new receiver is being built there,
    so the sender's next refit belongs to it)."""
    pending = _pending.pop(address, None)
    if pending is not None:
        pending.set()


def answer_refusal(address: str, reason: str, *, timeout_s: float) -> threading.Thread:
    """Answer the sender's next request at ``address`` with a rejection carrying ``reason``.

    Runs in a daemon thread for at most ``timeout_s`` (the receiver's own timeout) or until
    another receiver is built at ``address`` in this process (``cancel_refusal``), then closes
    its socket; returns the thread (tests join it).
    """

    cancel_refusal(address)
    cancelled = _pending[address] = threading.Event()

    def serve() -> None:
        context = zmq.Context()
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + timeout_s
        try:
            sock.connect(address)
            while not sock.poll(100, zmq.POLLIN):  # short slices: a new receiver cancels us
                if cancelled.is_set() or time.monotonic() > deadline:
                    return
            if not cancelled.is_set():
                sock.recv_multipart()
                sock.setsockopt(zmq.SNDTIMEO, 2000)
                sock.send_multipart(encode(Reply(False, "begin", -1, reason[:4096])))
        except zmq.ZMQError:
            pass  # best effort: the receiver's constructor has raised the refusal already
        finally:
            sock.close(linger=0)
            context.term()
            if _pending.get(address) is cancelled:
                del _pending[address]

    thread = threading.Thread(target=serve, name="refit-refusal", daemon=True)
    thread.start()
    return thread

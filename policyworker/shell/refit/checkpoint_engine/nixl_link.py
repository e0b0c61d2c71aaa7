"""One NIXL agent as the ``nixl`` checkpoint engine uses it: framed control messages over NIXL
notifications, bounded waits on them, registered buffers and one-sided WRITEs.

The ``nixl`` package is imported here, lazily (``import_nixl``), and only versions this code was
run against are accepted. A control message is a ``functional.wire.nixl_frames`` frame; a
bucket's notification rides on its WRITE, so NIXL delivers it only after the bytes. Every wait
is bounded; a peer that does not answer in time is a ``RefitTimeoutError`` and one whose
connection dropped a ``RefitPeerLostError``, both naming the phase and the peer.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from policyworker._lazy import installed_version
from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.wire.nixl_frames import NixlFrame, decode_frame, encode_frame
from policyworker.shell.refit.collective.plan import RefitPeerLostError

__all__ = [
    "NIXL_VERSIONS",
    "Slots",
    "NixlLink",
    "check_refit_error",
    "import_nixl",
    "nixl_problem",
]

# The agent API this engine calls (nixl_agent, notifications, partial metadata, initialize_xfer)
# as run here with 1.5.1; a major release may change it, an older one lacks pieces of it.
NIXL_VERSIONS = ((1, 5), (2, 0))
_DISTS = ("nixl", "nixl-cu12", "nixl-cu13")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def nixl_problem() -> str | None:
    """Why the ``nixl`` backend cannot run in this process, or None when it can."""
    try:
        import_nixl()
    except ImportError as exc:
        return str(exc)
    return None


def import_nixl() -> Any:
    """``nixl._api`` (agent and config classes) after the version check.

    Raises:
        ImportError: the package does not import, or its version is outside ``NIXL_VERSIONS``.
    """
    try:
        import nixl._api as api  # noqa: PLC0415 -- optional, GPU hosts' package
    except ImportError as exc:
        msg = (
            f"the 'nixl' package does not import here ({exc}); install it (pip install "
            "'policyworker[nixl]', or nixl-cu13 on a CUDA 13 host)"
        )
        raise ImportError(msg) from exc
    if "NIXL_LOG_LEVEL" not in os.environ:  # its INFO lines go to stdout, one per agent made
        logging.getLogger("nixl").setLevel(logging.WARNING)
    version = installed_version(*_DISTS) or "unknown"
    low, high = NIXL_VERSIONS
    if not low <= _version_tuple(version)[:2] < high:
        msg = (
            f"nixl {version} is not supported by the nixl checkpoint engine (needs >= "
            f"{'.'.join(map(str, low))}, < {'.'.join(map(str, high))}); install nixl 1.5.x"
        )
        raise ImportError(msg)
    return api


def span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """``(address, length, device index)`` of a contiguous tensor's bytes (device 0 on CPU)."""
    return (tensor.data_ptr(), tensor.nbytes, max(tensor.get_device(), 0))


def mem_type_of(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


class Slots:
    """``count`` registered staging slots of ``nbytes`` each, in one buffer on ``device``."""

    def __init__(self, link: NixlLink, count: int, nbytes: int, device: torch.device) -> None:
        self.count, self.nbytes = count, nbytes
        self.buffer = torch.empty(count * nbytes, dtype=torch.uint8, device=device)
        self.descs = link.register(self.buffer)

    def fits(self, count: int, nbytes: int, device: torch.device) -> bool:
        return self.count >= count and self.nbytes >= nbytes and self.buffer.device == device

    def slot(self, index: int, used: int) -> torch.Tensor:
        start = (index % self.count) * self.nbytes
        return self.buffer[start : start + used]

    def addresses(self) -> list[list[int]]:
        """``[address, length, device index]`` of each slot (what a peer WRITEs into)."""
        base, _, device = span(self.buffer)
        return [[base + i * self.nbytes, self.nbytes, device] for i in range(self.count)]


class NixlLink:
    """This rank's NIXL agent (UCX backend), its peers, its inbox and its registrations."""

    def __init__(self, *, timeout_s: float) -> None:
        api = import_nixl()
        self.name = f"policyworker-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # No progress thread: NIXL's spins with no pause and took a core from the casts (a CPU
        # refit ran 7-30x slower on two cores). Every wait here polls the agent instead, and
        # each side's last message (DONE, FAIL, ABORT: small) follows the BEGIN / ACCEPT
        # exchange, whose connection is made while both sides poll.
        self.agent = api.nixl_agent(
            self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self.timeout_s = timeout_s
        self.peers: dict[str, str] = {}  # agent name -> what errors call it
        self._inbox: dict[str, list[NixlFrame]] = {}
        self._registered: list[Any] = []
        self._inflight: dict[int, tuple[str, Any, str]] = {}  # ticket -> (peer, handle, phase)
        self._tickets = 0

    def metadata_b64(self) -> str:
        """This agent's metadata as text (the driver's metadata list may travel as JSON)."""
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def add_peer(self, metadata_b64: str, label: str) -> str:
        """Load a peer's metadata (from its ``metadata_b64``); its agent name."""
        name = self.agent.add_remote_agent(base64.b64decode(metadata_b64))
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.peers[name] = label
        return name

    def register(self, buffer: torch.Tensor) -> Any:
        """Register ``buffer`` (DRAM on CPU, VRAM on CUDA); the registration's descriptors."""
        descs = self.agent.register_memory(buffer)
        self._registered.append(descs)
        return descs

    def deregister(self, descs: Any) -> None:
        self._registered.remove(descs)
        self.agent.deregister_memory(descs)

    def partial_metadata(self, descs: Any) -> bytes:
        """What a peer loads to WRITE into ``descs`` (registered after it loaded ours)."""
        return bytes(self.agent.get_partial_agent_metadata(descs, False))

    def load_partial(self, raw: bytes) -> None:
        self.agent.add_remote_agent(raw)

    def send(self, peer: str, header: Mapping[str, Any], payload: bytes = b"") -> None:
        """One control message to ``peer``; a dropped connection is ``RefitPeerLostError``."""
        try:
            self.agent.send_notif(peer, encode_frame(header, payload))
        except Exception as exc:  # noqa: BLE001 -- nixl's binding errors share no base class
            raise self._lost(peer, f"sending {header.get('kind')}", exc) from None

    def write(
        self,
        peer: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        mem_types: tuple[str, str],
        header: Mapping[str, Any],
    ) -> int | None:
        """Start one WRITE of the ``(address, length, device)`` ranges ``local`` (inside this
        agent's registrations) to ``remote`` (inside the peer's), pairwise, of ``mem_types``
        ("DRAM" / "VRAM", local then remote); the notification
        ``header`` follows the bytes. The WRITE's ticket for ``wait_written`` (None: nothing to
        write, the notification sent alone)."""
        if not local:  # empty tensors only: NIXL has no zero-length transfer
            self.send(peer, header)
            return None
        phase = f"writing bucket {header.get('index')}"
        try:
            handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(local, mem_types[0]),
                self.agent.get_xfer_descs(remote, mem_types[1]),
                peer,
                encode_frame(header),
            )
            state = self.agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 -- nixl's binding errors share no base class
            raise self._lost(peer, phase, exc) from None
        if state == "ERR":
            raise self._lost(peer, phase, "state ERR")
        self._tickets += 1
        self._inflight[self._tickets] = (peer, handle, phase)
        return self._tickets

    def wait_written(self, tickets: Iterable[int | None], phase: str) -> None:
        """Block until the WRITEs of ``tickets`` completed (bounded by ``timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s
        for ticket in tickets:
            while ticket in self._inflight:
                self._progress()
                if ticket in self._inflight and time.monotonic() > deadline:
                    raise self._timeout(self._inflight[ticket][0], phase)
                time.sleep(0.0001)

    def _progress(self) -> None:
        """Poll every WRITE in flight: NIXL's UCX backend advances a transfer when asked."""
        for ticket, (peer, handle, phase) in list(self._inflight.items()):
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as exc:  # noqa: BLE001 -- binding errors share no base class
                raise self._lost(peer, phase, exc) from None
            if state == "ERR":
                raise self._lost(peer, phase, "state ERR")
            if state == "DONE":
                del self._inflight[ticket]
                handle.release()

    def wait(
        self, peer: str, refit: str, kinds: Iterable[str], phase: str, *, index: int | None = None
    ) -> NixlFrame:
        """The first message from ``peer`` of one of ``kinds`` for refit ``refit`` (and bucket
        ``index`` when given), waiting at most ``timeout_s``; ``refit="*"`` takes any refit."""
        kinds = tuple(kinds)
        deadline, pause = time.monotonic() + self.timeout_s, 0.0001
        while True:
            self._progress()
            found = self.take(peer, refit, kinds, index)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise self._timeout(peer, phase)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def forget(self, peer: str) -> None:
        """Drop every queued message from ``peer``."""
        self._poll()
        self._inbox.pop(peer, None)

    def take(
        self, peer: str, refit: str, kinds: tuple[str, ...], index: int | None = None
    ) -> NixlFrame | None:
        """The first queued message ``wait`` would return, without waiting (None if none)."""
        self._poll()
        queue = self._inbox.get(peer, [])
        for i, message in enumerate(queue):
            header = message.header
            if (
                message.kind in kinds
                and (refit == "*" or header.get("refit") == refit)
                # an ABORT / FAIL carries no index: it answers a wait for any bucket
                and (index is None or header.get("index", index) == index)
            ):
                return queue.pop(i)
        return None

    def _poll(self) -> None:
        for sender, raws in self.agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            queue = self._inbox.setdefault(name, [])
            queue.extend(m for m in map(decode_frame, raws) if m is not None)

    def _timeout(self, peer: str, phase: str) -> RefitTimeoutError:
        msg = (
            f"nixl refit: no progress in phase {phase!r} within {self.timeout_s:g} s from "
            f"{self.peers.get(peer, peer)} (agent {peer}); the peer may be dead or unresponsive. "
            "finalize_checkpoint_engine, then set the engine up again with live members"
        )
        return RefitTimeoutError(msg)

    def _lost(self, peer: str, phase: str, cause: object) -> RefitPeerLostError:
        msg = (
            f"nixl refit: the connection to {self.peers.get(peer, peer)} (agent {peer}) dropped "
            f"in phase {phase!r} ({cause}); the peer may be dead. finalize_checkpoint_engine, "
            "then set the engine up again with live members"
        )
        return RefitPeerLostError(msg)

    def close(self) -> None:
        """Deregister every buffer and forget the peers (the agent goes with this object)."""
        for _, handle, _ in self._inflight.values():
            with contextlib.suppress(Exception):  # best effort while tearing down
                handle.release()  # NIXL cancels a WRITE still in flight
        self._inflight.clear()
        for descs in list(self._registered):
            with contextlib.suppress(Exception):  # best effort while tearing down
                self.deregister(descs)
        for peer in list(self.peers):
            with contextlib.suppress(Exception):  # a dead peer cannot be told
                self.agent.remove_remote_agent(peer)
        self.peers.clear()
        self._inbox.clear()


def check_refit_error(message: NixlFrame, who: str) -> None:
    """``RefitError`` carrying a peer's FAIL / REFUSE / ABORT reason."""
    reason = message.header.get("reason", "")
    if message.kind == "REFUSE":
        msg = f"{who} refused the refit before any byte was written: {reason}"
    elif message.kind == "ABORT":
        msg = f"{who} aborted the refit: {reason}"
    else:
        msg = f"{who} failed the refit: {reason}"
    raise RefitError(msg)

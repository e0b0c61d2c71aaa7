"""The sender's side of a one-pass refit: cast the fp32 master weights straight into the
receiver's registered memory.

Protocol (docs/refit-protocol.md, "One-pass refits"): BEGIN carries the manifest and the id of
the registration this sender holds; the receiver checks the manifest exactly as for a staged
refit and ACKs with its registration (or just its id when the sender's copy holds); the sender
checks every destination against its manifest (``functional.arena.destination_problems``)
before it writes a byte, casts every tensor into its destination in grouped copies, records one
interprocess event on CUDA, and sends COMPLETE (with that event). Any failure after the ACK is
announced with ABORT, so the receiver drops the refit at once (its version unchanged; an
in-place receiver reports ``stale``).

``OnePassWriter`` keeps the opened arena and the destination views per manifest between refits:
a steady-state refit opens and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.arena import (
    destination_problems,
    destination_view,
    ordered_destinations,
)
from policyworker.functional.buckets import TensorSpec
from policyworker.functional.wire.codec import (
    Complete,
    RefitRejectedError,
    Reply,
    ShmBuffer,
    encode,
)
from policyworker.functional.wire.one_pass import Registration, decode_registration
from policyworker.shell.refit.weight_stream import RefitSource
from policyworker.shell.refit.zmq import staging
from policyworker.shell.refit.zmq.sender import Exchange, ZmqIpcSender
from policyworker.shell.refit.zmq.shared_buffers import SharedFile, open_shared_buffer
from policyworker.shell.refit.zmq.staging import (
    cached_copy_groups,
    grouped_copy_,
    run_copy_groups,
)

__all__ = ["OnePassWriter", "stream_one_pass"]

# Small sources are cast in groups of at most this many tensors / elements: grouping saves
# launches, while bounding a group bounds the merged LoRA weights a group keeps alive at once.
_GROUP_TENSORS = 512
_GROUP_ELEMENTS = 1 << 28


class OnePassWriter:
    """The receiver's registered arena as this sender opened it, and typed views of it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._registration: Registration | None = None
        self._target: torch.Tensor | None = None  # the opened arena (or spare) the sender writes
        self._file: SharedFile | None = None  # a CPU arena's file, held to check its size
        self._views: tuple[Sequence[TensorSpec], list[torch.Tensor]] | None = None
        self._numels: list[int] = []  # elements of each view, in manifest order
        self._groups: dict[str, Any] = {}  # the copy groups of a plain stream into the views
        self._written: torch.cuda.Event | None = None

    @property
    def held_id(self) -> str:
        """The registration id this sender holds ("" for none)."""
        return "" if self._registration is None else self._registration.id

    def adopt(self, reply: Reply) -> None:
        """Take the registration from the BEGIN's ACK (opening its arena when it is new)."""
        if reply.registration is None:
            msg = (
                f"refit rank {self.rank}: the receiver answered a one-pass BEGIN without a "
                "registration (an older receiver?); install the same policyworker on both sides"
            )
            raise RefitError(msg)
        decoded = decode_registration(reply.registration, reply.registration_frames)
        if isinstance(decoded, str):
            if decoded != self.held_id:
                msg = f"refit rank {self.rank}: the receiver confirmed unknown id {decoded!r}"
                raise RefitError(msg)
            return
        self.close()
        ref = decoded.write_target
        if isinstance(ref, ShmBuffer):
            self._file = SharedFile(ref)
            target = self._file.map()
        else:
            target = open_shared_buffer(ref)
        if target.numel() < decoded.arena_bytes:
            msg = (
                f"refit rank {self.rank}: the registered arena holds {target.numel()} bytes, "
                f"less than the {decoded.arena_bytes} it announced"
            )
            raise RefitError(msg)
        self._registration, self._target = decoded, target[: decoded.arena_bytes]

    def views(self, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        """The destination of every manifest entry, in manifest order; ``RefitError`` naming
        every problem (before anything is written) when the registration does not fit it."""
        if self._views is not None and self._views[0] is specs:
            return self._views[1]
        registration, target = self._registration, self._target
        assert registration is not None and target is not None
        problems = destination_problems(
            specs, registration.destinations, arena_bytes=registration.arena_bytes
        )
        if problems:
            msg = (
                f"refit rank {self.rank}: the receiver's registration does not fit this "
                "manifest; nothing was written: " + " | ".join(problems)
            )
            raise RefitError(msg)
        ordered = ordered_destinations(specs, registration.destinations)
        views = [destination_view(target, d) for d in ordered]
        self._views, self._numels = (specs, views), [d.numel for d in ordered]
        return views

    def check_arena(self) -> None:
        """``RefitError`` naming the arena's file when the receiver shrank it since it was
        mapped: a write past a shared file's end is a SIGBUS, so this runs around the writes."""
        problem = None if self._file is None else self._file.problem()
        if problem is not None:
            self.close()  # ask for the whole registration at the next BEGIN
            msg = f"refit rank {self.rank}: the receiver's registered arena: {problem}"
            raise RefitError(msg)

    def write(
        self,
        specs: Sequence[TensorSpec],
        views: list[torch.Tensor],
        sources: Iterator[RefitSource],
        plain: Sequence[torch.Tensor] | None = None,
        *,
        mirrors: Sequence[list[torch.Tensor]] = (),
    ) -> bytes:
        """Cast every source into its destination; on CUDA, the handle of the event recorded
        after the casts (b"" on CPU, where the writes are done when this returns).

        A large tensor's cast is launched as soon as its source arrives (the GPU works while
        this loop walks the rest); small ones are cast in grouped launches. ``plain`` (the
        stream's ``RefitStream.plain``): the sources as whole tensors, copied with the copy
        groups of the last refit while they are the same tensor objects, and ``sources`` is
        not read. ``mirrors``: other receivers' views of the same manifest (a fan-out: every
        tensor cast once), filled from ``views`` once every cast is launched, before the event;
        their arenas are their writers' to check. A CPU arena's file size is checked before and
        after (``check_arena``).
        """
        self.check_arena()
        if plain is None:
            self._write(specs, views, sources)
        else:
            groups = cached_copy_groups(self._groups, "plain", views, plain)
            with torch.no_grad():  # plain sources are live parameters, not detached
                run_copy_groups(groups, non_blocking=True)
        for mirror in mirrors:
            grouped_copy_(mirror, views, non_blocking=True)
        event = self._record()
        self.check_arena()
        return event

    def _write(
        self, specs: Sequence[TensorSpec], views: list[torch.Tensor], sources: Iterator[RefitSource]
    ) -> None:
        large_numel = staging.LARGE_COPY_NUMEL
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        group_elements = 0
        # This loop is the one-pass refit's per-tensor host cost (on a GPU, launches of a small
        # model's tensors can fall behind its copies): nothing in it is recomputed per refit that
        # the cached views already know.
        cached = self._views is not None and self._views[1] is views
        numels = self._numels if cached else [view.numel() for view in views]
        for index, (spec, view, numel) in enumerate(zip(specs, views, numels, strict=True)):
            source = next(sources, None)
            if (
                source is None
                or source.name != spec.name
                or source.dtype != spec.dtype
                or source.tensor.shape != spec.shape
            ):
                got = None if source is None else source.spec
                msg = f"internal: the params stream sent {got} at {index}; the manifest has {spec}"
                raise RefitError(msg)
            if numel >= large_numel:
                view.copy_(source.tensor, non_blocking=True)
                continue
            dsts.append(view)
            srcs.append(source.tensor)
            group_elements += numel
            if len(dsts) >= _GROUP_TENSORS or group_elements >= _GROUP_ELEMENTS:
                grouped_copy_(dsts, srcs, non_blocking=True)
                dsts, srcs, group_elements = [], [], 0
        grouped_copy_(dsts, srcs, non_blocking=True)

    def _record(self) -> bytes:
        """On CUDA, record the event COMPLETE hands over, after every write; b"" on CPU."""
        target = self._target
        assert target is not None
        if target.device.type != "cuda":
            return b""
        if self._written is None:
            self._written = torch.cuda.Event(interprocess=True)
        self._written.record(torch.cuda.current_stream(target.device))
        return bytes(self._written.ipc_handle())

    def close(self) -> None:
        """Forget the registration and unmap its arena."""
        self._registration = self._target = self._views = None
        self._groups.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


def stream_one_pass(
    zmq: ZmqIpcSender,
    writer: OnePassWriter,
    specs: Sequence[TensorSpec],
    sources: Iterator[RefitSource],
    *,
    timeout_s: float,
    transport: str,
    or_staged: Callable[[Exchange], dict[str, Any]] | None = None,
    plain: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One one-pass refit over ``zmq``'s socket; returns the receiver's report.

    ``or_staged`` (the default refit): a receiver that did not register its memory answers
    the BEGIN with a staged ACK, and ``or_staged(exchange)`` streams the staged refit it began.
    ``plain``: the stream's ``RefitStream.plain`` (see ``OnePassWriter.write``).
    """
    with zmq.exchange("stream_weights_via_ipc_zmq", timeout_s=timeout_s) as exchange:
        begin = zmq.begin_frames(
            specs, transport, one_pass=writer.held_id, or_staged=or_staged is not None
        )
        reply = exchange.ask(begin, phase="begin")  # a rejection raises here
        if or_staged is not None and reply.registration is None:
            return or_staged(exchange)
        try:
            try:
                writer.adopt(reply)
                views = writer.views(specs)  # checked against the manifest: nothing written yet
            except BaseException:
                writer.close()  # ask for the whole registration at the next BEGIN
                raise
            event = writer.write(specs, views, sources, plain)
        except BaseException as exc:
            exchange.abort(f"{type(exc).__name__}: {exc}")
            raise
        try:
            complete = encode(Complete(0, one_pass=True, written_event=event, refit=exchange.refit))
            return exchange.ask(complete, phase="complete").report
        except (RefitTimeoutError, RefitRejectedError):
            writer.close()  # the receiver may have re-registered since: ask for all of it again
            raise

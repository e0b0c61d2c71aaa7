"""The receiver's refit state machine, free of sockets: ``RefitServer`` and its buffers.

``RefitServer.handle`` takes the frames of one request (BEGIN, BUCKET, COMPLETE or ABORT) and
returns the reply frames and an ``Outcome``; the socket loop in ``zmq_receiver`` only moves
frames. ``ReceivedBuffers`` opens each staging buffer of the sender once (a /dev/shm file or a
CUDA IPC handle) and caches each bucket's source views; a ``WeightSink`` (the receiver's
``WeightApplier``) validates and applies the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch

from policyworker.errors import RefitError
from policyworker.functional.buckets import (
    DEFAULT_ALIGNMENT,
    SplitLayout,
    TensorSpec,
    split_layout,
    split_views,
    unpack_tensors,
)
from policyworker.functional.wire.codec import (
    Abort,
    Begin,
    Bucket,
    Complete,
    CudaBuffer,
    ManifestCache,
    ProtocolError,
    Reply,
    ShmBuffer,
    check_bucket,
    decode_request,
    encode,
)
from policyworker.functional.wire.one_pass import Registration, encode_registration
from policyworker.shell.refit.zmq.shared_buffers import SharedFile, open_shared_buffer, shm_problem
from policyworker.shell.refit.zmq.staging import open_event

__all__ = ["Outcome", "ReceivedBuffers", "RefitServer", "WeightSink"]


class WeightSink(Protocol):
    """Where a refit lands (``receiver.WeightApplier``): validated first, written second."""

    @property
    def generation(self) -> int: ...
    def begin(self, manifest: Sequence[TensorSpec], *, located: bool = False) -> None: ...
    def apply_batch(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None: ...
    def apply_indexed(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> None: ...
    def prepare(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> Any: ...
    def apply_prepared(self, batch: Any) -> None: ...
    def commit(self, *, num_buckets: int) -> Any: ...
    def abort(self, reason: str) -> None: ...
    def expect_external_write(self) -> None: ...


class OnePassTarget(Protocol):
    """A receiver's registered memory (``one_pass_receiver.WeightArena``)."""

    def registration(self) -> Registration:
        """The registration of the module's tensors where they are now: rebuilt (new id), and
        the sink rebound, when they were re-pointed, so the sink need not look again."""
        ...

    def before_write(self) -> None: ...
    def after_write(self, written_event: bytes) -> None: ...


_NOT_REGISTERED = (
    "this receiver did not register for one-pass refits; build it with "
    "HFWeightReceiver(module, ..., one_pass=True) or the default one_pass=None (an nn.Module "
    "target), or stream with one_pass=None (the default: staged where the receiver did not "
    "register) or False"
)


class _Mapped:
    """One opened staging buffer, the source views of the buckets it carried and, for CUDA, per
    region of the buffer the sender fills (a ping-pong half, named by its filled-event handle):
    the sender's filled event (opened once) and this side's consumed event."""

    def __init__(self, tensor: torch.Tensor, file: SharedFile | None = None) -> None:
        self.tensor = tensor
        # a shm buffer: ``tensor`` is this side's own copy, filled per bucket from ``file``
        self.file = file
        self.views: dict[
            tuple[Any, ...], Any
        ] = {}  # (indices, offsets) -> the sink's prepared batch
        self._events: dict[bytes, tuple[torch.cuda.Event, torch.cuda.Event, bytes]] = {}

    def wait_filled(self, filled_handle: bytes) -> bytes:
        """Queue, on the current stream, a wait for the sender's casts into this region; the
        region's key for ``record_consumed``."""
        events = self._events.get(filled_handle)
        if events is None:
            if len(self._events) >= 64:  # a misbehaving sender must not grow this without bound
                self._events.clear()
            consumed = torch.cuda.Event(interprocess=True)
            consumed.record(
                torch.cuda.current_stream(self.tensor.device)
            )  # before its handle is taken
            filled = open_event(self.tensor.device, filled_handle)
            events = self._events[filled_handle] = (filled, consumed, bytes(consumed.ipc_handle()))
        torch.cuda.current_stream(self.tensor.device).wait_event(events[0])
        return filled_handle

    def load(self, start: int, end: int) -> None:
        """Copy bytes ``[start, end)`` of a shm buffer into this side's copy (no-op for CUDA)."""
        if self.file is not None:
            self.file.read_into(self.tensor, start, end)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def record_consumed(self, key: bytes) -> bytes:
        """Record the event the sender waits on, after the queued reads of the region.

        Returns its handle.
        """
        _, consumed, handle = self._events[key]
        consumed.record(torch.cuda.current_stream(self.tensor.device))
        return handle


class ReceivedBuffers:
    """Receiver-side mappings of the sender's staging buffers, by buffer identity.

    A buffer is opened once; after a complete refit only the mappings of buffers the sender
    keeps (``keep`` in their reference, used by that refit) stay open; a failed refit closes all.
    """

    def __init__(self) -> None:
        self._open: dict[Any, _Mapped] = {}
        self._used: dict[Any, bool] = {}  # key -> keep, for the refit in progress

    @staticmethod
    def _key(ref: ShmBuffer | CudaBuffer) -> Any:
        if isinstance(ref, ShmBuffer):
            return ("shm", ref.name, ref.size)
        return ("cuda", ref.device_uuid, ref.handle, ref.storage_offset_bytes, ref.size)

    def open(self, ref: ShmBuffer | CudaBuffer) -> _Mapped:
        key = self._key(ref)
        mapped = self._open.get(key)
        if mapped is not None and isinstance(ref, ShmBuffer):
            problem = shm_problem(ref)  # a kept file truncated or removed since it was opened
            if problem is not None:
                self._open.pop(key).close()
                raise ProtocolError(f"{problem} (it shrank or went away since it was mapped)")
        if mapped is None:
            if isinstance(ref, ShmBuffer):
                # read by descriptor into this side's memory: a mapping of a file its owner
                # shrinks is a SIGBUS mid-copy, a short read is an error
                file = SharedFile(ref)
                mapped = _Mapped(torch.empty(max(ref.size, 1), dtype=torch.uint8)[: ref.size], file)
            else:
                mapped = _Mapped(open_shared_buffer(ref))
            self._open[key] = mapped
        self._used[key] = ref.keep
        return mapped

    def finish(self, *, ok: bool) -> None:
        """End of a refit: keep only the kept buffers it used (none when it failed)."""
        keep = {k for k, kept in self._used.items() if kept} if ok else set()
        for key, mapped in self._open.items():
            if key not in keep:
                mapped.close()
        self._open = {k: m for k, m in self._open.items() if k in keep}
        self._used = {}

    def clear(self) -> None:
        for mapped in self._open.values():
            mapped.close()
        self._open.clear()
        self._used.clear()

    def forget_views(self) -> None:
        """Drop the cached bucket views (they were built for another manifest)."""
        for mapped in self._open.values():
            mapped.views.clear()

    def __len__(self) -> int:
        return len(self._open)


@attrs.frozen
class Outcome:
    """What one handled message means for the serving loop."""

    done: bool = False
    report: Any = None
    error: RefitError | None = None


class RefitServer:
    """The receiver's protocol state machine.

    Frames in, reply frames + outcome out; never raises.
    """

    def __init__(self, sink: WeightSink, *, one_pass: OnePassTarget | None = None) -> None:
        self.sink = sink
        self.one_pass = one_pass
        self._one_pass_session = False  # the refit in progress is written by the sender itself
        self._registered_id = ""
        self._refit = ""  # the id of the refit in progress (its BEGIN's), echoed in each reply
        self._manifest: tuple[TensorSpec, ...] | None = None
        self._views_manifest: tuple[TensorSpec, ...] | None = None
        self._sink_generation = sink.generation
        self._manifests = ManifestCache()
        self._sizes: tuple[int, ...] = ()
        self._alignment = DEFAULT_ALIGNMENT
        self._received = bytearray()
        self._count = 0
        self._buffers = ReceivedBuffers()
        self._num_buckets = 0
        self._gpu_pending: torch.device | None = None  # a device with reads queued but not awaited
        # per (indices, offsets) of this manifest: how to cut a bucket out of a fresh mapping with
        # one split (None: it needs unpack_tensors); kept across refits that free their staging
        self._layouts: dict[tuple[Any, ...], SplitLayout | None] = {}

    @property
    def in_refit(self) -> bool:
        return self._manifest is not None

    @property
    def open_buffers(self) -> int:
        """Staging buffers mapped right now (kept ones stay mapped between refits)."""
        return len(self._buffers)

    def release_buffers(self) -> None:
        """Close every kept mapping (the sender's kept staging can then really be freed)."""
        if self._manifest is None:
            self._buffers.clear()

    def handle(self, frames: Sequence[bytes]) -> tuple[list[bytes], Outcome]:
        """Every reply names the request it answers: its kind, refit id and bucket sequence
        (a rejection of a message that could not be read names none)."""
        kind, seq, refit = "unknown", -1, ""
        try:
            message = decode_request(frames, manifests=self._manifests)
            kind, refit = type(message).__name__.lower(), message.refit
            if isinstance(message, Bucket):
                seq = message.seq
            return self._dispatch(message)
        except Exception as exc:  # a bad message must be answered, never crash the receiver
            reason = str(exc) if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
            self.fail(reason)
            error = RefitError(f"refit rejected ({kind}): {reason}")
            reply = Reply(False, kind, seq, reason, refit=refit)
            return encode(reply), Outcome(done=True, error=error)

    def _drain_gpu(self) -> None:
        """Wait for every queued read of the sender's buffers (before closing their mappings)."""
        if self._gpu_pending is not None:
            torch.cuda.current_stream(self._gpu_pending).synchronize()
            self._gpu_pending = None

    def fail(self, reason: str) -> None:
        """Drop the refit in progress.

        The sink keeps the previous version or marks itself stale.
        """
        self._drain_gpu()
        if self._manifest is not None:
            self.sink.abort(reason)
        self._manifest = None
        self._one_pass_session = False
        self._received = bytearray()
        self._buffers.finish(ok=False)

    def _dispatch(self, message: Begin | Bucket | Complete | Abort) -> tuple[list[bytes], Outcome]:
        if isinstance(message, Begin):
            if self._manifest is not None and message.refit == self._refit:
                raise ProtocolError("BEGIN while a refit is in progress; finish or abort it first")
            if self._manifest is not None:
                # a sender begins a new refit only after giving up the last (a timeout): the
                # unfinished one is dropped, so a retry after a timeout works at once
                self.fail(f"superseded by refit {message.refit!r}")
            self._refit = message.refit
            if message.one_pass is not None and (
                self.one_pass is not None or not message.or_staged
            ):
                return self._begin_one_pass(message)
            # a staged BEGIN, or a default one-pass BEGIN to a receiver that did not register:
            # a staged refit, ACKed without a registration
            self.sink.begin(message.manifest)  # finds the destinations again if they moved
            if message.manifest is not self._views_manifest:  # cached views hold its dtypes/shapes
                self._buffers.forget_views()
                self._layouts.clear()
                self._views_manifest = message.manifest
            if self.sink.generation != self._sink_generation:  # cached batches hold old targets
                self._buffers.forget_views()
                self._sink_generation = self.sink.generation
            self._manifest = message.manifest
            self._sizes = (
                self._manifests.sizes
                if message.manifest is self._manifests.specs
                else tuple(s.nbytes for s in message.manifest)
            )
            self._alignment, self._num_buckets = message.alignment, 0
            self._received, self._count = bytearray(len(message.manifest)), 0
            return encode(Reply(True, "begin", refit=self._refit)), Outcome()
        if isinstance(message, Abort):
            answer = encode(Reply(True, "abort", refit=message.refit))
            if self._manifest is None or message.refit != self._refit:
                # Nothing to abort: a sender sends ABORT only after BEGIN, so this one belongs to
                # a refit this side already ended (rejected, timed out). Answered and dropped;
                # the refit this receive() waits for is still to come.
                return answer, Outcome()
            self.fail(f"sender aborted: {message.reason}")
            error = RefitError(f"the sender aborted the refit: {message.reason}")
            return answer, Outcome(done=True, error=error)
        if self._manifest is None:
            raise ProtocolError(f"{type(message).__name__.upper()} before BEGIN")
        if message.refit != self._refit:
            raise ProtocolError(
                f"{type(message).__name__.upper()} of refit {message.refit!r:.80} inside refit "
                f"{self._refit!r}"
            )
        if isinstance(message, Complete):
            return self._complete(message)
        return self._bucket(message)

    def _begin_one_pass(self, message: Begin) -> tuple[list[bytes], Outcome]:
        """Check the manifest, then hand the sender the registration: from the ACK on it may
        write the registered memory (an in-place receiver is stale until COMPLETE)."""
        if self.one_pass is None:
            raise ProtocolError(_NOT_REGISTERED)
        registration = self.one_pass.registration()  # rebuilt (new id) if the layout changed
        if registration.id != self._registered_id:  # cached staged batches hold old destinations
            self._buffers.forget_views()
            self._views_manifest, self._registered_id = None, registration.id
        # refused here, before the sender may write anything; registration() has just
        # checked where the module's tensors are (and rebound the sink if they moved)
        self.sink.begin(message.manifest, located=True)
        self._manifest, self._one_pass_session = message.manifest, True
        self._num_buckets = 0
        self.sink.expect_external_write()
        self.one_pass.before_write()
        body, raw = encode_registration(registration, held_id=message.one_pass)
        reply = Reply(
            True,
            "begin",
            registration=body,
            registration_frames=tuple(raw),
            refit=self._refit,
        )
        return encode(reply), Outcome()

    def _bucket(self, bucket: Bucket) -> tuple[list[bytes], Outcome]:
        manifest = self._manifest
        assert manifest is not None
        if self._one_pass_session:
            raise ProtocolError("BUCKET in a one-pass refit (the sender writes registered memory)")
        problems = check_bucket(
            bucket,
            manifest,
            self._sizes,
            self._received,
            alignment=self._alignment,
            buffer_size=bucket.buffer.size,
        )
        if problems:
            raise ProtocolError(
                f"bucket {bucket.seq} rejected before any write: " + "; ".join(problems[:20])
            )
        mapped = self._buffers.open(bucket.buffer)
        mapped.load(bucket.offsets[0] if bucket.offsets else 0, bucket.used_bytes)
        key = (bucket.indices, bucket.offsets)  # for this manifest (see BEGIN); valid while mapped
        batch = mapped.views.get(key)
        if batch is None:
            if len(mapped.views) > 4096:  # a misbehaving sender must not grow this without bound
                mapped.views.clear()
            buffer = mapped.tensor[: bucket.buffer.size]
            specs = [manifest[i] for i in bucket.indices]
            if key not in self._layouts:
                if len(self._layouts) > 4096:
                    self._layouts.clear()
                self._layouts[key] = split_layout(specs, bucket.offsets)
            layout = self._layouts[key]
            if layout is not None and buffer.data_ptr() % layout.dtype.itemsize == 0:
                views = split_views(buffer, layout)
            else:
                views = unpack_tensors(buffer, specs, bucket.offsets)
            batch = self.sink.prepare(bucket.indices, views)
            if bucket.buffer.keep:
                mapped.views[key] = batch
        consumed = b""
        if isinstance(bucket.buffer, CudaBuffer):
            region = mapped.wait_filled(bucket.buffer.filled_event)
            self._gpu_pending = mapped.tensor.device
            self.sink.apply_prepared(batch)
            consumed = mapped.record_consumed(region)  # the sender's next write there waits on it
        else:
            self.sink.apply_prepared(batch)
        del batch
        received = self._received
        for index in bucket.indices:
            received[index] = 1
        self._count += len(bucket.indices)
        self._num_buckets += 1
        reply = Reply(True, "bucket", bucket.seq, consumed_event=consumed, refit=self._refit)
        return encode(reply), Outcome()

    def _complete(self, message: Complete) -> tuple[list[bytes], Outcome]:
        manifest = self._manifest
        assert manifest is not None
        if message.one_pass != self._one_pass_session:
            raise ProtocolError(
                f"a {'one-pass' if message.one_pass else 'staged'} COMPLETE ended a "
                f"{'one-pass' if self._one_pass_session else 'staged'} refit"
            )
        if self.one_pass is not None and self._one_pass_session:
            self.one_pass.after_write(message.written_event)
        elif self._count != len(manifest):
            missing = [s.name for s, got in zip(manifest, self._received, strict=True) if not got]
            raise ProtocolError(f"COMPLETE with {len(missing)} tensors never sent: {missing[:20]}")
        self._drain_gpu()  # the new version is in place before anyone is told so
        self._buffers.finish(ok=True)
        report = self.sink.commit(num_buckets=self._num_buckets)
        self._manifest, self._one_pass_session = None, False
        summary = (
            attrs.asdict(report, filter=lambda a, _: a.name != "names")
            if attrs.has(type(report))
            else {}
        )
        reply = Reply(True, "complete", report=summary, refit=self._refit)
        return encode(reply), Outcome(done=True, report=report)

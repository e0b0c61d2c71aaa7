"""Non-colocated refit: a packed broadcast from trainer rank 0 over a separate process group.

``init_collective`` builds a process group of trainer ranks ``0..T-1`` and inference ranks
``T+i`` over a ``TCPStore`` (NCCL on CUDA, gloo on CPU) without touching the default group.
One refit (``CollectiveRefit.broadcast_weights`` on every trainer rank,
``CollectiveWeightReceiver.receive`` on every inference rank) is, on the wire:

1. header: a broadcast of ``int64[2] = [MAGIC, n]``, then of ``n`` bytes of JSON (protocol,
   version, refit sequence number, layout, target bucket bytes, ``num_buffers``, alignment,
   manifest ``[[name, dtype, shape], ...]``). Both sides plan the buckets from THIS header, so
   bucket boundaries and buffer counts agree by construction (no local defaults on receivers);
2. agreement: an all-reduce of one flag per rank; a rank that rejects the header (manifest
   against its ``refit_info``, protocol version) sets its flag and every rank stops at once;
3. buckets: one broadcast per planned bucket, ``num_buffers`` in flight (one CUDA stream per
   slot on the sender); receivers post ``num_buffers`` receives ahead and apply each bucket
   through ``HFWeightReceiver`` (validate, then write / stage);
4. status: an all-reduce of one flag per rank; receivers commit only if every rank applied
   everything (so ``atomic=True`` receivers keep the previous version on any failure).

Layouts (docs/refit-collective.md): ``aligned`` (default) packs each bucket with
``plan_ipc_buckets`` -- tensors at 512-byte offsets, a bucket never exceeds the target except a
single oversized tensor sent alone -- so every received slice is dtype-aligned and viewed without
a copy; ``legacy`` (``use_legacy_packing=True``) is the reference layout: plain concatenation, a
bucket closed right after the tensor that crosses the target.

Every wait polls its collective with a deadline (the group's ``timeout_s``, or
``refit_timeout_s`` when given, which also arms a ``Watchdog`` thread that aborts the group). A
wait past its deadline, or a peer whose connection drops, marks the group broken and raises
``RefitTimeoutError`` naming rank, phase and peer count; build a new group (``init_collective``
on a fresh port, on every member) before the next refit.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from torch import nn

# torch.distributed re-exports these without `as`, so the checker sees them as private there.
from torch._C._distributed_c10d import Backend, PrefixStore, TCPStore

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import (
    DEFAULT_ALIGNMENT,
    TensorSpec,
    align_up,
    pack_tensors,
    plan_broadcast_buckets,
    plan_ipc_buckets,
    unpack_tensors,
)
from policyworker.shell.refit.params import refit_stream
from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport
from policyworker.shell.refit.watchdog import Watchdog, check_timeout_s
from policyworker.shell.refit.wire import (
    DTYPES_BY_NAME,
    MAX_HEADER_BYTES,
    ProtocolError,
    RefitRejectedError,
    decode_versioned_json,
    dtype_name,
)

__all__ = [
    "CPU_DEFAULT_BUCKET_BYTES",
    "CUDA_DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_NUM_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "MAGIC",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "CollectiveHeader",
    "CollectiveRefit",
    "CollectiveWeightReceiver",
    "PlannedBucket",
    "RefitPeerLostError",
    "broadcast_model_weights",
    "cpu_offload_cycle",
    "decode_header",
    "default_bucket_bytes",
    "encode_header",
    "init_collective",
    "plan_collective_buckets",
]

PROTOCOL = "policyworker-collective-refit"
PROTOCOL_VERSION = 1
MAGIC = 0x70777266  # "pwrf": the first int of every header broadcast
DEFAULT_NUM_BUFFERS = 2
DEFAULT_TIMEOUT_S = 600.0
CPU_DEFAULT_BUCKET_BYTES = 64 << 20
CUDA_DEFAULT_BUCKET_CAP_BYTES = 1 << 30  # per slot: large enough to saturate NCCL
CUDA_DEFAULT_BUCKET_FRACTION = 0.02  # of the device's total memory
MAX_NUM_BUFFERS = 64
Layout = Literal["aligned", "legacy"]

# A gloo group whose collective is stuck cannot be destroyed without waiting for that
# collective's own timeout; broken groups are parked here instead of blocking the caller.
_BROKEN_GROUPS: list[Any] = []


class RefitPeerLostError(RefitTimeoutError):
    """A peer's connection dropped mid-refit: the refit can make no more progress."""


# ----------------------------------------------------------------------------- header + plan


@attrs.frozen
class CollectiveHeader:
    """What every rank plans one refit from (sent by trainer rank 0)."""

    refit_seq: int
    layout: Layout
    target_bytes: int
    num_buffers: int
    alignment: int
    manifest: tuple[TensorSpec, ...]


@attrs.frozen
class PlannedBucket:
    """One broadcast: which manifest entries, at which byte offsets, how many bytes travel."""

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int


def encode_header(header: CollectiveHeader) -> bytes:
    """The JSON bytes of a header."""
    body = {
        "protocol": PROTOCOL,
        "version": PROTOCOL_VERSION,
        "refit_seq": header.refit_seq,
        "layout": header.layout,
        "target_bytes": header.target_bytes,
        "num_buffers": header.num_buffers,
        "alignment": header.alignment,
        "manifest": [[s.name, dtype_name(s.dtype), list(s.shape)] for s in header.manifest],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _field_int(body: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(
            f"collective header field {key!r} must be an int in [{low}, {high}], got {value!r:.40}"
        )
    return value


def decode_header(raw: bytes) -> CollectiveHeader:
    """Parse and type-check a header. Raises ``ProtocolError`` with the reason; never evaluates."""
    body = decode_versioned_json(
        raw, protocol=PROTOCOL, version=PROTOCOL_VERSION, what="collective header"
    )
    layout = body.get("layout")
    if layout not in ("aligned", "legacy"):
        raise ProtocolError(
            f"collective header field 'layout' must be 'aligned' or 'legacy', got {layout!r:.40}"
        )
    manifest = body.get("manifest")
    if not isinstance(manifest, list):
        raise ProtocolError(
            f"collective header field 'manifest' must be a list, got {type(manifest).__name__}"
        )
    specs = []
    for i, item in enumerate(manifest):
        ok = (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and 0 < len(item[0]) <= 1024
            and item[1] in DTYPES_BY_NAME
            and isinstance(item[2], list)
            and len(item[2]) <= 16
            and all(type(d) is int and 0 <= d <= 1 << 48 for d in item[2])
        )
        if not ok:
            raise ProtocolError(
                f"collective header manifest[{i}] must be [name, dtype, shape], got {item!r:.80}"
            )
        specs.append(TensorSpec(item[0], tuple(item[2]), DTYPES_BY_NAME[item[1]]))
    return CollectiveHeader(
        _field_int(body, "refit_seq", 0, 1 << 62),
        layout,
        _field_int(body, "target_bytes", 1, 1 << 48),
        _field_int(body, "num_buffers", 1, MAX_NUM_BUFFERS),
        _field_int(body, "alignment", 1, 1 << 20),
        tuple(specs),
    )


def plan_collective_buckets(
    specs: Sequence[TensorSpec],
    *,
    layout: Layout,
    target_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> list[PlannedBucket]:
    """Bucket plan of a refit; both sides call it with the header's values.

    ``aligned``: ``plan_ipc_buckets`` with the target rounded up to the alignment (offsets are
    multiples of ``alignment``; a bucket exceeds the target only as a single oversized tensor).
    ``legacy``: ``plan_broadcast_buckets`` (close after the crossing tensor), offsets are the
    running byte sums (no padding). ``nbytes`` is the end of the last tensor's bytes.
    """
    if layout == "legacy":
        planned = []
        for indices in plan_broadcast_buckets(specs, target_bytes):
            offsets, end = [], 0
            for i in indices:
                offsets.append(end)
                end += specs[i].nbytes
            planned.append(PlannedBucket(tuple(indices), tuple(offsets), end))
        return planned
    buffer_bytes = align_up(target_bytes, alignment)
    return [
        PlannedBucket(
            b.indices,
            b.offsets,
            max(o + specs[i].nbytes for i, o in zip(b.indices, b.offsets, strict=True)),
        )
        for b in plan_ipc_buckets(specs, buffer_bytes, alignment=alignment)
    ]


def default_bucket_bytes(device: torch.device) -> int:
    """The sender's bucket target when ``buffer_size_bytes`` is None.

    Receivers never compute it.
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return max(
            DEFAULT_ALIGNMENT,
            min(int(total * CUDA_DEFAULT_BUCKET_FRACTION), CUDA_DEFAULT_BUCKET_CAP_BYTES),
        )
    return CPU_DEFAULT_BUCKET_BYTES


def _specs_from_refit_info(refit_info: Mapping[str, Any]) -> list[TensorSpec]:
    if not refit_info:
        msg = "refit_info is empty; pass prepare_refit_info() of the model being sent"
        raise ValueError(msg)
    return [TensorSpec(name, tuple(shape), dtype) for name, (shape, dtype) in refit_info.items()]


# ----------------------------------------------------------------------------- the group


def init_collective(
    ip: str,
    port: int,
    world_size: int,
    *,
    train_world_size: int,
    rank: int,
    device: torch.device | str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CollectiveRefit:
    """Join the refit group: trainer ranks ``0..T-1``, inference ranks ``T..world_size-1``.

    Rank 0 hosts the ``TCPStore`` at ``(ip, port)``. Blocks until every member joined (bounded by
    ``timeout_s``). The default process group, if any, is left untouched.

    Raises:
        ValueError: a size, rank, port or timeout is out of range.
    """
    if not (
        isinstance(world_size, int)
        and isinstance(train_world_size, int)
        and 1 <= train_world_size < world_size
    ):
        msg = (
            f"train_world_size {train_world_size!r} and world_size {world_size!r} must be ints "
            "with "
            "1 <= train_world_size < world_size (the group needs at least one inference rank)"
        )
        raise ValueError(msg)
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        msg = (
            f"rank {rank!r} must be an int in [0, {world_size}); trainer ranks keep their rank, "
            "inference rank i is T + i"
        )
        raise ValueError(msg)
    if not (isinstance(port, int) and 0 < port < 65536):
        msg = (
            f"port {port!r} must be an int in [1, 65535]; every member must pass the same ip and "
            "port"
        )
        raise ValueError(msg)
    check_timeout_s("timeout_s", timeout_s)
    device = torch.device(device) if device is not None else torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(ip, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = PrefixStore("policyworker-collective-refit", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return CollectiveRefit(
        pg,
        store=store,
        rank=rank,
        world_size=world_size,
        train_world_size=train_world_size,
        device=device,
        timeout_s=timeout_s,
    )


class _Waits:
    """Bounded waits of one refit: poll each collective; fire the watchdog when nothing moves."""

    def __init__(self, group: CollectiveRefit, refit_timeout_s: float | None) -> None:
        self.group = group
        self.timeout_s = float(refit_timeout_s) if refit_timeout_s is not None else group.timeout_s
        self.watchdog = (
            Watchdog(refit_timeout_s, group._abort_pg) if refit_timeout_s is not None else None
        )
        self.last = time.monotonic()

    def wait(self, work: Any, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.kick(phase)
        pause = 0.0
        while not work.is_completed():
            fired = self.watchdog is not None and self.watchdog.fired
            if fired or time.monotonic() - self.last > self.timeout_s:
                raise self.group._fail(
                    RefitTimeoutError, phase, f"no progress within {self.timeout_s:g} s"
                )
            time.sleep(pause)
            pause = min(2e-3, 2 * pause + 2e-5)
        try:
            work.wait()
        except RuntimeError as exc:
            raise self.group._fail(
                RefitPeerLostError, phase, f"a peer's connection dropped ({str(exc)[:300]})"
            ) from None
        self.last = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.kick()


class CollectiveRefit:
    """One member's handle on the refit group (``init_collective`` builds it)."""

    def __init__(
        self,
        pg: Backend,
        *,
        store: Any,
        rank: int,
        world_size: int,
        train_world_size: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.pg: Backend | None = pg  # None once closed
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.train_world_size = train_world_size
        self.device = device
        self.timeout_s = timeout_s
        self.broken: str | None = None
        self.refit_seq = 0

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.train_world_size

    def _peers(self) -> str:
        return (
            f"{self.world_size - 1} peers (trainer ranks 0..{self.train_world_size - 1}, "
            f"inference ranks {self.train_world_size}..{self.world_size - 1})"
        )

    def _abort_pg(self) -> None:
        abort = getattr(self.pg, "abort", None) or getattr(self.pg, "_abort", None)
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()

    def _fail(self, cls: type[RefitTimeoutError], phase: str, why: str) -> RefitTimeoutError:
        """Mark the group broken, abort it (best effort) and return the error to raise."""
        self.broken = f"phase {phase!r}: {why}"
        self._abort_pg()
        _BROKEN_GROUPS.append(self.pg)
        msg = (
            f"collective refit rank {self.rank}/{self.world_size}: {why} in phase {phase!r} with "
            f"{self._peers()}. "
            "The group was aborted: call init_collective on every member (a fresh port) before "
            "the next refit."
        )
        return cls(msg)

    # Any: torch's stubs declare no collectives (broadcast, allreduce) on the c10d Backend class
    # that ProcessGroupGloo/NCCL derive from, though both have them at runtime.
    def _live_pg(self) -> Any:
        if self.pg is None:
            msg = (
                f"collective refit group of rank {self.rank} was closed; call init_collective "
                "on every member (a fresh port) to build a new one"
            )
            raise RefitError(msg)
        return self.pg

    def _check_usable(self) -> None:
        self._live_pg()
        if self.broken is not None:
            msg = (
                f"collective refit group of rank {self.rank} is broken ({self.broken}); call "
                "init_collective "
                "on every member (a fresh port) to build a new one"
            )
            raise RefitError(msg)

    # -- collectives shared by both sides

    def _exchange_header(self, waits: _Waits, payload: bytes | None) -> bytes:
        size = torch.tensor(
            [MAGIC, len(payload) if payload is not None else 0],
            dtype=torch.int64,
            device=self.device,
        )
        waits.wait(self._live_pg().broadcast(size, 0), "header size")
        magic, nbytes = (int(v) for v in size.tolist())
        if magic != MAGIC or not 0 < nbytes <= MAX_HEADER_BYTES:
            raise self._fail(
                RefitPeerLostError,
                "header size",
                f"the header broadcast carried magic {magic:#x} and {nbytes} bytes, not a refit "
                "header",
            )
        raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if payload is not None:
            raw.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        waits.wait(self._live_pg().broadcast(raw, 0), "header")
        return bytes(raw.cpu().numpy().tobytes())

    def _agree(self, waits: _Waits, failed: bool, phase: str) -> list[int]:
        """All-reduce one flag per rank; the ranks that set theirs."""
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        flags[self.rank] = int(failed)
        waits.wait(self._live_pg().allreduce([flags]), phase)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def _buffer(self, slots: list[torch.Tensor | None], slot: int, nbytes: int) -> torch.Tensor:
        buf = slots[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            slots[slot] = buf
        return buf[:nbytes]

    # -- sender

    def broadcast_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        refit_info: Mapping[str, Any],
        buffer_size_bytes: int | None = None,
        num_buffers: int | None = None,
        use_legacy_packing: bool = False,
        refit_timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Broadcast one refit from trainer rank 0 (every trainer rank calls this together).

        ``named_tensors`` yields ``(hf_name, tensor)`` in ``refit_info`` order; each tensor is
        cast to its ``refit_info`` dtype straight into the bucket (trainer ranks other than 0
        iterate it too, in lockstep, so sharded gathers stay collective, and send nothing).

        Returns a report: ``refit_seq``, ``layout``, ``target_bytes``, ``num_buffers``,
        ``num_buckets``, ``bucket_bytes`` (bytes of each bucket broadcast), ``num_bytes``,
        ``num_tensors``, ``seconds``.

        Raises:
            ValueError: an argument is out of range, or this is an inference rank.
            RefitRejectedError: an inference rank rejected the header or failed to apply a bucket.
            RefitTimeoutError: no progress within the deadline, or a peer dropped (group broken).
        """
        if not self.is_trainer:
            msg = (
                f"broadcast_weights runs on trainer ranks 0..{self.train_world_size - 1}; rank "
                f"{self.rank} is an "
                "inference rank: use CollectiveWeightReceiver(...).receive()"
            )
            raise ValueError(msg)
        for key, value, high in (
            ("buffer_size_bytes", buffer_size_bytes, 1 << 48),
            ("num_buffers", num_buffers, MAX_NUM_BUFFERS),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high
            ):
                msg = f"{key} {value!r} must be None (a default) or an int in [1, {high}]"
                raise ValueError(msg)
        check_timeout_s("refit_timeout_s", refit_timeout_s, none_means="no watchdog")
        specs = _specs_from_refit_info(refit_info)
        self._check_usable()
        header = CollectiveHeader(
            self.refit_seq + 1,
            "legacy" if use_legacy_packing else "aligned",
            buffer_size_bytes or default_bucket_bytes(self.device),
            num_buffers or DEFAULT_NUM_BUFFERS,
            DEFAULT_ALIGNMENT,
            tuple(specs),
        )
        started = time.monotonic()
        waits = _Waits(self, refit_timeout_s)
        with waits.watchdog or contextlib.nullcontext():
            raw = self._exchange_header(waits, encode_header(header) if self.rank == 0 else None)
            same = raw == encode_header(header)  # trainer ranks must agree on the manifest too
            rejected = self._agree(waits, not same, "header agreement")
            if rejected:
                msg = (
                    f"collective refit: rank(s) {rejected} rejected the header of refit "
                    f"{header.refit_seq} "
                    "(manifest vs their refit_info, or a different trainer-side manifest); "
                    "nothing was written. "
                    "See those ranks' errors for the names."
                )
                raise RefitRejectedError(msg)
            plan = plan_collective_buckets(
                specs,
                layout=header.layout,
                target_bytes=header.target_bytes,
                alignment=header.alignment,
            )
            sizes = self._send_buckets(waits, plan, specs, iter(named_tensors), header)
            failed = self._agree(waits, False, "apply status")
        self.refit_seq = header.refit_seq
        if failed:
            msg = (
                f"collective refit {header.refit_seq}: rank(s) {failed} failed to apply the "
                "weights (in-place "
                "receivers are stale, atomic ones kept their previous version); see their errors"
            )
            raise RefitRejectedError(msg)
        return {
            "refit_seq": header.refit_seq,
            "layout": header.layout,
            "target_bytes": header.target_bytes,
            "num_buffers": header.num_buffers,
            "num_buckets": len(plan),
            "bucket_bytes": sizes,
            "num_bytes": sum(s.nbytes for s in specs),
            "num_tensors": len(specs),
            "seconds": time.monotonic() - started,
        }

    def _send_buckets(
        self,
        waits: _Waits,
        plan: Sequence[PlannedBucket],
        specs: Sequence[TensorSpec],
        sources: Iterator[tuple[str, torch.Tensor]],
        header: CollectiveHeader,
    ) -> list[int]:
        cuda = self.device.type == "cuda"
        n = header.num_buffers
        slots: list[torch.Tensor | None] = [None] * n
        works: list[Any] = [None] * n
        streams = [torch.cuda.Stream(self.device) for _ in range(n)] if cuda else [None] * n
        sizes: list[int] = []
        for seq, bucket in enumerate(plan):
            slot = seq % n
            if works[slot] is not None:
                waits.wait(works[slot], f"bucket {seq - n}")
                works[slot] = None
            items = [self._next_source(sources, specs[i]) for i in bucket.indices]
            if bucket.nbytes == 0:
                continue
            buf = self._buffer(slots, slot, bucket.nbytes)
            stream = streams[slot]
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                if self.rank == 0:
                    _fill(
                        buf,
                        [specs[i] for i in bucket.indices],
                        items,
                        bucket.offsets,
                        legacy=header.layout == "legacy",
                        stream=stream,
                    )
                works[slot] = self._live_pg().broadcast(buf, 0)
            sizes.append(bucket.nbytes)
        for slot, work in enumerate(works):
            if work is not None:
                waits.wait(work, f"bucket slot {slot} (drain)")
        for stream in streams:
            if stream is not None:
                stream.synchronize()
        if next(sources, None) is not None:
            raise self._fail(
                RefitPeerLostError,
                "end of stream",
                "the named tensors outlasted refit_info (the sender's stream and metadata "
                "disagree)",
            )
        return sizes

    def _next_source(
        self, sources: Iterator[tuple[str, torch.Tensor]], spec: TensorSpec
    ) -> torch.Tensor:
        item = next(sources, None)
        if item is None or item[0] != spec.name or tuple(item[1].shape) != spec.shape:
            got = "end of stream" if item is None else f"{item[0]!r} {list(item[1].shape)}"
            # Peers are waiting inside a collective: abort the group so they fail fast too.
            raise self._fail(
                RefitPeerLostError,
                "stream",
                f"the named tensors sent {got} where refit_info says {spec.name!r} "
                f"{list(spec.shape)}",
            )
        return item[1]

    def close(self) -> None:
        """Drop this member's handle (a broken group stays parked; see ``_BROKEN_GROUPS``)."""
        self.pg = None
        self.store = None


def _fill(
    buf: torch.Tensor,
    specs: Sequence[TensorSpec],
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    *,
    legacy: bool,
    stream: Any,
) -> None:
    """Cast each tensor into its slot of the bucket bytes (aligned: straight into a typed view)."""
    for tensor in tensors:
        if stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)  # freed by the caller while this stream may still read it
    if legacy:  # offsets may be misaligned for the dtype: cast first, then copy raw bytes
        pack_tensors(
            [t.detach().to(s.dtype) for s, t in zip(specs, tensors, strict=True)], offsets, buf
        )
        return
    for spec, tensor, offset in zip(specs, tensors, offsets, strict=True):
        if spec.nbytes:
            buf[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape).copy_(
                tensor.detach(), non_blocking=True
            )


# ----------------------------------------------------------------------------- receiver


class CollectiveWeightReceiver:
    """The inference side: receives refits broadcast over ``group`` into ``target``.

    ``target`` is an ``HFWeightReceiver`` (its validation, ``atomic`` and ``stale`` semantics are
    used as is), or an ``nn.Module`` / ``load_weights(iterable)`` callable, for which one is built
    from ``refit_info`` and ``atomic``.
    """

    def __init__(
        self,
        target: HFWeightReceiver | nn.Module | Callable[..., Any],
        *,
        group: CollectiveRefit,
        refit_info: Mapping[str, Any] | None = None,
        atomic: bool = False,
    ) -> None:
        if group.is_trainer:
            msg = (
                f"CollectiveWeightReceiver runs on inference ranks >= {group.train_world_size}; "
                f"rank {group.rank} "
                "is a trainer rank: call broadcast_weights there"
            )
            raise ValueError(msg)
        self.receiver = HFWeightReceiver.socketless(target, refit_info=refit_info, atomic=atomic)
        self.group = group
        self.last_header: CollectiveHeader | None = None

    @property
    def version(self) -> int:
        return self.receiver.version

    @property
    def stale(self) -> bool:
        return self.receiver.stale

    def receive(self, *, refit_timeout_s: float | None = None) -> RefitReport:
        """Serve one refit; returns the receiver's report.

        Raises:
            RefitError: this rank rejected the header or failed to apply (its reason), or another
                rank did (nothing committed on any rank).
            RefitTimeoutError: no progress within the deadline, or a peer dropped (group broken).
        """
        group = self.group
        group._check_usable()
        waits = _Waits(group, refit_timeout_s)
        with waits.watchdog or contextlib.nullcontext():
            raw = group._exchange_header(waits, None)
            header, reason = None, None
            try:
                header = decode_header(raw)
                self.receiver.begin_refit(list(header.manifest))
            except RefitError as exc:
                reason = f"rank {group.rank} rejected the header: {exc}"
            rejected = group._agree(waits, reason is not None, "header agreement")
            if rejected:
                if reason is None:
                    self.receiver.abort_refit("another rank rejected the header")
                    reason = f"rank(s) {rejected} rejected the header; nothing was written here"
                raise RefitRejectedError(reason)
            assert header is not None
            self.last_header = header
            plan = plan_collective_buckets(
                header.manifest,
                layout=header.layout,
                target_bytes=header.target_bytes,
                alignment=header.alignment,
            )
            reason = self._receive_buckets(waits, plan, header)
            failed = group._agree(waits, reason is not None, "apply status")
            if self.group.device.type == "cuda":
                torch.cuda.current_stream(self.group.device).synchronize()  # weights fully written
        group.refit_seq = header.refit_seq
        if failed:
            self.receiver.abort_refit("a rank failed to apply the refit")
            raise RefitRejectedError(
                reason
                or f"rank(s) {failed} failed to apply refit {header.refit_seq}; not committed"
            )
        return self.receiver.commit_refit(num_buckets=len(plan))

    def _receive_buckets(
        self, waits: _Waits, plan: Sequence[PlannedBucket], header: CollectiveHeader
    ) -> str | None:
        group, n = self.group, header.num_buffers
        slots: list[torch.Tensor | None] = [None] * n
        works: list[Any] = [None] * n
        views: list[torch.Tensor | None] = [None] * n

        def post(seq: int) -> None:
            slot = seq % n
            if plan[seq].nbytes:
                buf = group._buffer(slots, slot, plan[seq].nbytes)
                views[slot] = buf
                works[slot] = group._live_pg().broadcast(buf, 0)

        for seq in range(min(n, len(plan))):
            post(seq)
        reason = None
        for seq, bucket in enumerate(plan):
            slot = seq % n
            if works[slot] is not None:
                waits.wait(works[slot], f"bucket {seq}")
                works[slot] = None
            if reason is None:  # after a failure keep draining so the peers never hang
                specs = [header.manifest[i] for i in bucket.indices]
                buf = views[slot] if bucket.nbytes else None
                if buf is None:
                    buf = torch.empty(0, dtype=torch.uint8, device=group.device)
                try:
                    tensors = unpack_tensors(buf, specs, bucket.offsets)
                    self.receiver.apply_batch(
                        [(s.name, t) for s, t in zip(specs, tensors, strict=True)]
                    )
                except (RefitError, ValueError) as exc:
                    reason = f"rank {group.rank} failed to apply bucket {seq}: {exc}"
            if seq + n < len(plan):
                post(seq + n)
        return reason


# ----------------------------------------------------------------------------- worker glue


@contextlib.contextmanager
def cpu_offload_cycle(
    enabled: bool,
    onload: Callable[[], Any] | None,
    offload: Callable[[], Any] | None,
    *,
    transport: str,
) -> Iterator[None]:
    """With cpu_offload, move the model to the device for the transfer and back after."""
    if not enabled:
        yield
        return
    if onload is None or offload is None:
        msg = (
            f"cpu_offload=True needs both onload and offload callables for {transport}; pass the "
            "worker's moves"
        )
        raise ValueError(msg)
    warnings.warn(
        f"cpu_offload adds an onload/offload cycle around {transport} (the model is moved to the "
        "device "
        "and back)",
        stacklevel=3,
    )
    onload()
    try:
        yield
    finally:
        offload()


def broadcast_model_weights(
    group: CollectiveRefit | None,
    model: nn.Module,
    refit_dtype: torch.dtype,
    *,
    draft_model: nn.Module | None = None,
    kv_scales: Any = None,
    refit_timeout_s: float | None = None,
    buffer_size_bytes: int | None = None,
    num_buffers: int | None = None,
    use_legacy_packing: bool = False,
    cpu_offload: bool = False,
    onload: Callable[[], Any] | None = None,
    offload: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """``PolicyWorker.broadcast_weights_for_collective``.

    Sends the model's refit stream over ``group``.
    """
    if group is None:
        msg = (
            "broadcast_weights_for_collective needs a refit group: call init_collective(ip, "
            "port, world_size, ...) first"
        )
        raise ValueError(msg)
    if kv_scales is not None:
        msg = (
            "kv_scales: FP8 KV-cache scales are unsupported in this worker (no FP8 kvcache "
            "calibration path); "
            "pass kv_scales=None"
        )
        raise ValueError(msg)
    with cpu_offload_cycle(
        cpu_offload, onload, offload, transport="broadcast_weights_for_collective"
    ):
        stream = refit_stream(model, refit_dtype, draft_model)  # one walk: specs and tensors
        info = {s.name: (torch.Size(s.shape), s.dtype) for s in stream.specs}
        sources = ((s.name, s.tensor) for s in stream.sources)
        try:
            with torch.no_grad():  # the caller's grad mode comes back on every exit
                return group.broadcast_weights(
                    sources,
                    refit_info=info,
                    buffer_size_bytes=buffer_size_bytes,
                    num_buffers=num_buffers,
                    use_legacy_packing=use_legacy_packing,
                    refit_timeout_s=refit_timeout_s,
                )
        finally:
            sources.close()
            stream.sources.close()

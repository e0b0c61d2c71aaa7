"""``CollectiveRefit``: the process group of a collective refit and the trainer's broadcast.

It owns the group (built by ``collective.init_collective``), polls every collective against a
deadline (``RefitWaits``, with a ``Watchdog`` for ``refit_timeout_s``), marks the group broken
on a timeout or a lost peer, and on trainer rank 0 streams the planned buckets with
``num_buffers`` in flight (``broadcast_weights``). The inference side drives the same group
from ``collective_receiver``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

# torch.distributed re-exports these without `as`, so the checker sees them as private there.
from torch._C._distributed_c10d import Backend

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import (
    DEFAULT_ALIGNMENT,
    TensorSpec,
    pack_tensors,
)
from policyworker.functional.wire.codec import (
    MAX_HEADER_BYTES,
    RefitRejectedError,
)
from policyworker.shell.refit.collective.plan import (
    DEFAULT_NUM_BUFFERS,
    MAGIC,
    MAX_NUM_BUFFERS,
    CollectiveHeader,
    PlannedBucket,
    RefitPeerLostError,
    default_bucket_bytes,
    encode_header,
    plan_collective_buckets,
    specs_from_refit_info,
)
from policyworker.shell.refit.watchdog import Watchdog, check_timeout_s

__all__ = ["CollectiveRefit", "RefitWaits"]

# A gloo group whose collective is stuck cannot be destroyed without waiting for that
# collective's own timeout; broken groups are parked here instead of blocking the caller.
_BROKEN_GROUPS: list[Any] = []


class RefitWaits:
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

    def _exchange_header(self, waits: RefitWaits, payload: bytes | None) -> bytes:
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

    def _agree(self, waits: RefitWaits, failed: bool, phase: str) -> list[int]:
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
        specs = specs_from_refit_info(refit_info)
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
        waits = RefitWaits(self, refit_timeout_s)
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
        waits: RefitWaits,
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

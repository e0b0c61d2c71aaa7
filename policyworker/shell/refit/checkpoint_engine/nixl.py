"""The ``nixl`` checkpoint engine: refits as one-sided NIXL WRITEs into the rollout rank's memory.

Rollout rank ``r`` is fed by policy rank ``r % T`` (a policy rank without a rollout peer takes
part in the gathers and sends nothing; one with several packs each bucket once and WRITEs it to
each). Members may be on other hosts (UCX picks the transport: shared memory or CUDA IPC on one
host, RDMA or TCP across hosts); every member must use the same device type.

One refit, all control messages being NIXL notifications bound to the refit's id
(``nixl_link``):

1. the policy rank sends BEGIN with the manifest (names, shapes, dtypes of ``refit_info``) and
   its bucket plan's size; each rollout rank checks the manifest against its own
   ``refit_info`` (``HFWeightReceiver.begin_refit``) before any byte: REFUSE names the
   difference. ACCEPT says where to WRITE, with the partial agent metadata to reach it:
   - one-pass (``one_pass=None``, the default, where the rollout target is an ``nn.Module``
     that registers, as the ipc engine's): its ``WeightArena`` (the spare arena when atomic)
     registered with NIXL, and each manifest entry's byte range in it;
   - staged (a ``load_weights`` callable, a module that cannot register, ``one_pass=False``):
     ``num_buffers`` registered staging slots;
2. bucket ``k`` (``plan_ipc_buckets``: the same plan on both sides) is cast into the policy
   rank's registered slot ``k % num_buffers`` and WRITten to each peer (each tensor to its
   place in the arena, or the slot to the same slot), its notification (refit id + bucket
   index) delivered after the bytes; a staged rollout rank applies it (checked against the
   manifest, staged until commit when the receiver is atomic); either ACKs it, which frees the
   slot for bucket ``k + num_buffers``;
3. after the last bucket each rollout rank commits (every manifest entry arrived; an atomic
   one-pass receiver copies its spare arena live) and answers DONE with its report, or FAIL.

Memory is DRAM on CPU and VRAM on CUDA, from the slot's device (one code path). Every wait is
bounded by ``timeout_s``: a silent peer is a ``RefitTimeoutError`` naming the phase and the peer,
a dropped connection a ``RefitPeerLostError``; a policy rank that fails sends ABORT to its other
peers, which raise. The stream itself (dtypes of the seed's ``_refit_tensor_dtype``, LoRA merged,
draft tensors after the policy's) is the worker's ``_checkpoint_engine_params``, as for every
backend; the engine casts each tensor to its ``refit_info`` dtype while packing.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from policyworker.errors import RefitError
from policyworker.functional.arena import destination_view
from policyworker.functional.buckets import (
    IpcBucket,
    TensorSpec,
    align_up,
    plan_ipc_buckets,
    unpack_tensors,
)
from policyworker.functional.wire.codec import ManifestCache, encode_manifest
from policyworker.functional.wire.nixl_frames import NixlFrame
from policyworker.shell.refit.checkpoint_engine.base import (
    CheckpointEngine,
    check_engine_kwargs,
    one_pass_option,
)
from policyworker.shell.refit.checkpoint_engine.nixl_link import (
    NixlLink,
    Slots,
    check_refit_error,
    mem_type_of,
    span,
)
from policyworker.shell.refit.one_pass.receiver import WeightArena
from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport
from policyworker.shell.refit.watchdog import check_timeout_s
from policyworker.shell.refit.weight_applier import specs_from

__all__ = ["NixlCheckpointEngine"]

BACKEND = "nixl"
OPTIONS = ("device", "timeout_s", "num_buffers", "one_pass")
DEFAULT_TIMEOUT_S = 120.0
MAX_NUM_BUFFERS = 16


class NixlCheckpointEngine(CheckpointEngine):
    """One member's end. Options (``engine_kwargs``): ``device`` (where the slots live: default
    the current CUDA device, else CPU; the same type on every member), ``timeout_s`` (every wait,
    default 120 s), ``num_buffers`` (slots in flight per rollout rank, default 2) and, on a
    rollout rank, ``one_pass`` (None: WRITE into the module's weight arena where it registers,
    else staged; False: staged only, the weights left where they are; True: one-pass or raise)."""

    metadata_backend = BACKEND
    device_hint = "NIXL registers DRAM on cpu, VRAM on cuda"

    def __init__(self, *, bucket_size: int, **options: Any) -> None:
        check_engine_kwargs(BACKEND, options, OPTIONS)
        check_timeout_s("timeout_s", options.get("timeout_s", DEFAULT_TIMEOUT_S))
        buffers = options.get("num_buffers", 2)
        if isinstance(buffers, bool) or not isinstance(buffers, int):
            buffers = 0
        if not 1 <= buffers <= MAX_NUM_BUFFERS:
            msg = (
                f"engine_kwargs num_buffers {options.get('num_buffers')!r} must be an int in "
                f"[1, {MAX_NUM_BUFFERS}] (staging slots in flight per rollout rank; 2 overlaps "
                "one bucket's apply with the next one's write)"
            )
            raise ValueError(msg)
        self.one_pass: bool | None = one_pass_option(options)
        device = options.get("device")
        if device is None:
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        self.device = torch.device(device)
        self.bucket_size, self.num_buffers = bucket_size, buffers
        self.timeout_s = float(options.get("timeout_s", DEFAULT_TIMEOUT_S))
        self._link: NixlLink | None = None
        self.peers: list[tuple[str, int]] | None = None  # a policy rank's (agent, rollout rank)
        self._source: str | None = None  # a rollout rank's policy agent
        self._slots: Slots | None = None
        self._manifests = ManifestCache()
        self._specs: tuple[dict[str, Any], list[TensorSpec], bytes] | None = None
        self._plan: tuple[tuple[TensorSpec, ...], int, list[IpcBucket]] | None = None
        self._arena: tuple[torch.Tensor, Any] | None = None  # a rollout's registered arena
        self.last_report: dict[str, Any] | None = None
        self.last_mode: str | None = None  # "one-pass", "staged" or both, of the last send

    def prepare(self) -> dict[str, Any]:
        """Start this rank's NIXL agent (once until ``finalize``) and offer its metadata."""
        if self._link is None:
            self._link = NixlLink(timeout_s=self.timeout_s)
        return {
            "backend": BACKEND,
            "host": socket.gethostname(),
            "device": self.device.type,
            "agent": self._link.name,
            "nixl_metadata": self._link.metadata_b64(),
        }

    def _agent(self, call: str) -> NixlLink:
        if self._link is None:
            msg = f"{call} needs prepare() on every member first (this rank has no NIXL agent)"
            raise RefitError(msg)
        return self._link

    def join_policy(self, worker_rank: int, train: int, rollout: int, metadata: list[Any]) -> None:
        link = self._agent("init_policy_process_group")
        if metadata[worker_rank].get("agent") != link.name:
            msg = (
                f"metadata[{worker_rank}] is not this policy rank's prepare() result: pass every "
                "rank's metadata in rank order, policy ranks first"
            )
            raise ValueError(msg)
        self.peers = [
            (self._add(link, metadata[train + r], f"rollout rank {r}"), r)
            for r in range(worker_rank, rollout, train)
        ]

    def join_rollout(
        self, rollout_rank: int, train: int, rollout: int, metadata: list[Any]
    ) -> None:
        link = self._agent("init_rollout_process_group")
        source = rollout_rank % train
        self._source = self._add(link, metadata[source], f"policy rank {source}")

    @staticmethod
    def _add(link: NixlLink, entry: Mapping[str, Any], label: str) -> str:
        name = str(entry.get("agent"))
        if name in link.peers:  # joined again without finalize: the peer is loaded
            link.peers[name] = label
            return name
        return link.add_peer(str(entry.get("nixl_metadata")), label)

    # ------------------------------------------------------------------ policy side

    async def send_weights(
        self,
        weights: Iterator[tuple[str, torch.Tensor]],
        *,
        refit_info: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """One refit to this rank's rollout ranks; the report (None without peers)."""
        if self.peers is None or self._link is None:
            msg = "send_weights needs prepare() and init_policy_process_group on every member first"
            raise RefitError(msg)
        try:
            if not self.peers:
                for _ in weights:  # the gathers are collective: take part, send nothing
                    pass
                return None
            if refit_info is None:  # the manifest must precede the bytes: hold the stream
                pairs = list(weights)
                refit_info = {name: (tensor.shape, tensor.dtype) for name, tensor in pairs}
                weights = iter(pairs)
            specs, manifest = self._specs_of(refit_info)
            with torch.no_grad():
                self.last_report = self._send(self._link, specs, manifest, weights)
            self.last_mode = " + ".join(sorted(set(self.last_report["modes"])))
            return self.last_report
        finally:
            close = getattr(weights, "close", None)
            if close is not None:  # a generator left suspended would hold its gathers
                close()

    def _send(
        self,
        link: NixlLink,
        specs: list[TensorSpec],
        manifest: bytes,
        weights: Iterator[tuple[str, torch.Tensor]],
    ) -> dict[str, Any]:
        assert self.peers is not None
        started, refit = time.monotonic(), uuid.uuid4().hex[:16]
        buffer_bytes = align_up(self.bucket_size)
        plan = self._plan_of(tuple(specs), buffer_bytes)
        count = max(1, min(self.num_buffers, len(plan)))
        begin = {"kind": "BEGIN", "refit": refit, "buffer_bytes": buffer_bytes, "slots": count}
        peers = [name for name, _ in self.peers]
        targets: dict[str, dict[str, Any]] = {}  # each peer's ACCEPT header
        try:
            for peer in peers:
                link.forget(peer)  # answers to earlier refits: nothing of this one came yet
                link.send(peer, begin, manifest)
            for peer in peers:
                targets[peer] = self._accepted(link, peer, refit)
            slots = self._slots_for(link, count, max((b.used_bytes for b in plan), default=1))
            pending: list[list[int | None]] = [[] for _ in range(count)]  # WRITE tickets per slot
            stream = iter(weights)
            for k, bucket in enumerate(plan):
                if k >= count:  # slot k % count is free once every peer applied bucket k - count
                    for peer in peers:
                        self._answer(
                            link, peer, refit, "ACK", f"ACK of bucket {k - count}", k - count
                        )
                    link.wait_written(pending[k % count], f"write of bucket {k - count}")
                    pending[k % count] = []
                source = slots.slot(k, bucket.used_bytes)
                _pack(source, [specs[i] for i in bucket.indices], bucket.offsets, stream)
                if source.is_cuda:  # the casts must land before NIXL reads the slot
                    torch.cuda.current_stream(source.device).synchronize()
                header = {"kind": "BUCKET", "refit": refit, "index": k}
                for peer in peers:
                    accept = targets[peer]  # its memory's type: a module's arena is where it is
                    local, remote = _ranges(source, bucket, specs, accept, k % count)
                    types = (mem_type_of(source), str(accept["mem_type"]))
                    pending[k % count].append(link.write(peer, local, remote, types, header))
            link.wait_written([t for slot in pending for t in slot], "write of the last buckets")
            done = [self._answer(link, peer, refit, "DONE", "COMPLETE", None) for peer in peers]
        except BaseException as exc:
            for peer in peers:  # best effort: the other rollout ranks stop waiting now
                # unanswered: its ACCEPT never came, so it may take this BEGIN late; it skips it
                abort = {"kind": "ABORT", "refit": refit, "unanswered": peer not in targets}
                with contextlib.suppress(RefitError):
                    link.send(peer, {**abort, "reason": _reason(exc)})
            raise
        return {
            "backend": BACKEND,
            "refit": refit,
            "num_buckets": len(plan),
            "num_bytes": sum(s.nbytes for s in specs),
            "seconds": time.monotonic() - started,
            "receivers": [m.header.get("report") for m in done],
            "modes": [str(targets[peer].get("mode")) for peer in peers],
        }

    def _accepted(self, link: NixlLink, peer: str, refit: str) -> dict[str, Any]:
        """A peer's answer to BEGIN: where to WRITE (its slots, or its arena's base and one
        span per manifest entry); REFUSE raises."""
        message = self._answer(link, peer, refit, "ACCEPT", "BEGIN answer", None)
        link.load_partial(message.payload)  # registered after it loaded our metadata
        return message.header

    @staticmethod
    def _answer(
        link: NixlLink, peer: str, refit: str, kind: str, phase: str, index: int | None
    ) -> Any:
        message = link.wait(peer, refit, (kind, "REFUSE", "FAIL"), phase, index=index)
        if message.kind != kind:
            check_refit_error(message, link.peers.get(peer, peer))
        return message

    def _specs_of(self, refit_info: Mapping[str, Any]) -> tuple[list[TensorSpec], bytes]:
        """The manifest of ``refit_info`` and its BEGIN frame, built once while unchanged."""
        info = dict(refit_info)
        if self._specs is None or self._specs[0] != info:
            specs = specs_from(info)
            self._specs = (info, specs, encode_manifest(specs))
        return self._specs[1], self._specs[2]

    def _plan_of(self, specs: tuple[TensorSpec, ...], buffer_bytes: int) -> list[IpcBucket]:
        if self._plan is None or self._plan[0] != specs or self._plan[1] != buffer_bytes:
            self._plan = (specs, buffer_bytes, plan_ipc_buckets(specs, buffer_bytes))
        return self._plan[2]

    def _slots_for(self, link: NixlLink, count: int, nbytes: int) -> Slots:
        """This rank's registered slots, (re)registered when too few or too small."""
        if self._slots is None or not self._slots.fits(count, nbytes, self.device):
            if self._slots is not None:
                link.deregister(self._slots.descs)
            self._slots = None  # the old buffer goes before the new one is allocated
            self._slots = Slots(link, count, nbytes, self.device)
        return self._slots

    # ----------------------------------------------------------------- rollout side

    def receive_weights(self, receiver: HFWeightReceiver) -> RefitReport:
        """One refit from this rank's policy rank into ``receiver`` (checked, then applied)."""
        link = self._agent("receive_weights")
        if self._source is None:
            msg = "receive_weights needs init_rollout_process_group first (the policy's agent)"
            raise RefitError(msg)
        while True:  # a BEGIN its sender gave up on before our ACCEPT came is skipped
            begin = link.wait(self._source, "*", ("BEGIN",), "BEGIN")
            while (newer := link.take(self._source, "*", ("BEGIN",))) is not None:
                begin = newer  # older ones were given up too
            report = self._receive(link, self._source, begin, receiver)
            if report is not None:
                return report

    def _receive(
        self, link: NixlLink, source: str, begin: NixlFrame, receiver: HFWeightReceiver
    ) -> RefitReport | None:
        """The refit ``begin`` announces; None when its sender had already given it up."""
        refit = str(begin.header.get("refit"))
        try:
            specs = self._manifests.decode(begin.payload)
            arena = self._arena_of(receiver)  # before the refit begins: it may move the weights
            receiver.begin_refit(specs)
            plan = self._plan_of(specs, int(begin.header["buffer_bytes"]))
            spans = None if arena is None else self._spans(arena, specs)
        except Exception as exc:
            link.send(source, {"kind": "REFUSE", "refit": refit, "reason": _reason(exc)})
            msg = f"nixl refit {refit}: refused before any byte was written: {exc}"
            raise RefitError(msg) from exc
        try:
            count, slots = int(begin.header["slots"]), None
            if arena is None or spans is None:
                slots = self._slots_for(link, count, max((b.used_bytes for b in plan), default=1))
                mem, descs = slots.buffer, slots.descs
                accept = {"mode": "staged", "slots": slots.addresses()[:count]}
            else:  # the policy rank WRITEs each tensor into its place in the arena
                mem, descs = self._registered_arena(link, arena.write_target)
                arena.before_write()
                receiver.applier.expect_external_write()  # in place: stale until commit
                accept = {"mode": "one-pass", "base": list(span(mem)), "spans": spans}
            # the metadata every time (a few hundred bytes): an ACCEPT may be one its sender no
            # longer reads (a BEGIN it gave up on)
            header = {"kind": "ACCEPT", "refit": refit, "mem_type": mem_type_of(mem), **accept}
            link.send(source, header, link.partial_metadata(descs))
            for k, bucket in enumerate(plan):
                message = link.wait(source, refit, ("BUCKET", "ABORT"), f"bucket {k}", index=k)
                if message.kind == "ABORT":
                    if k == 0 and message.header.get("unanswered"):
                        receiver.abort_refit("its sender gave it up before our ACCEPT")
                        return None
                    check_refit_error(message, f"policy rank (agent {source})")
                if slots is not None:
                    views = unpack_tensors(
                        slots.slot(k % count, bucket.used_bytes),
                        [specs[i] for i in bucket.indices],
                        bucket.offsets,
                    )
                    receiver.apply_batch(zip(bucket.names, views, strict=True))
                    if mem.is_cuda:  # the copies out of the slot end before it is reused
                        torch.cuda.current_stream(mem.device).synchronize()
                link.send(source, {"kind": "ACK", "refit": refit, "index": k})
            if slots is None and arena is not None:
                arena.after_write(None)  # NIXL delivered every bucket's bytes before its notice
            report = receiver.commit_refit(num_buckets=len(plan))
        except BaseException as exc:
            receiver.abort_refit(_reason(exc))
            with contextlib.suppress(RefitError):  # a policy rank gone: our error says so
                link.send(source, {"kind": "FAIL", "refit": refit, "reason": _reason(exc)})
            raise
        link.send(source, {"kind": "DONE", "refit": refit, "report": report.summary()})
        return report

    def _arena_of(self, receiver: HFWeightReceiver) -> WeightArena | None:
        """The receiver's one-pass arena (registering it now, per ``one_pass``), current."""
        assert self._link is not None
        arena = receiver.register_one_pass(self.one_pass, where=f"nixl {self._link.name}")
        if arena is not None:
            arena.registration()  # rebuilt (moved again) if the module's weights were re-pointed
        return arena

    def _spans(self, arena: WeightArena, specs: tuple[TensorSpec, ...]) -> list[list[int]] | None:
        """``[offset, bytes]`` in the arena of each manifest entry, or None (staged) when one
        is not a dense row-major range (a WRITE range is contiguous bytes)."""
        target = arena.write_target
        dests = {d.name: d for d in arena.registration().destinations}
        spans = []
        for spec in specs:
            view = destination_view(target, dests[spec.name])
            if not view.is_contiguous():
                if self.one_pass:
                    msg = f"one_pass=True: {spec.name!r} is not contiguous in the arena"
                    raise ValueError(msg)
                return None
            spans.append([view.data_ptr() - target.data_ptr(), view.nbytes])
        return spans

    def _registered_arena(self, link: NixlLink, target: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self._arena is None or self._arena[0] is not target:  # new, or rebuilt
            if self._arena is not None:
                link.deregister(self._arena[1])
            self._arena = (target, link.register(target))
        return self._arena

    def finalize(self) -> None:
        """Deregister the slots and drop the agent; the next ``prepare()`` starts a new one."""
        if self._link is not None:
            self._link.close()
        self._link, self._slots, self.peers, self._source = None, None, None, None
        self._arena = None


def _ranges(
    source: torch.Tensor,
    bucket: IpcBucket,
    specs: list[TensorSpec],
    accept: Mapping[str, Any],
    slot: int,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The (local, remote) byte ranges of one bucket's WRITE to one peer: the packed slot into
    the peer's slot (staged), or each tensor into its place in the peer's arena (one-pass)."""
    address, nbytes, device = span(source)
    if accept.get("mode") != "one-pass":
        there, _, remote_device = accept["slots"][slot]
        return (
            ([(address, nbytes, device)], [(there, nbytes, remote_device)]) if nbytes else ([], [])
        )
    base, _, remote_device = accept["base"]
    spans = accept["spans"]
    local, remote = [], []
    for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
        there, size = spans[index] if index < len(spans) else (0, -1)
        if size != specs[index].nbytes:
            msg = (
                f"the rollout rank's arena holds {size} bytes for {specs[index].name!r}, the "
                f"manifest {specs[index].nbytes}: its registration and the manifest disagree"
            )
            raise RefitError(msg)
        if size:
            local.append((address + offset, size, device))
            remote.append((base + there, size, remote_device))
    return local, remote


def _pack(
    slot: torch.Tensor,
    specs: list[TensorSpec],
    offsets: tuple[int, ...],
    stream: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """Cast the stream's next ``len(specs)`` tensors into their places in ``slot``."""
    for spec, view in zip(specs, unpack_tensors(slot, specs, offsets), strict=True):
        pair = next(stream, None)
        if pair is None or pair[0] != spec.name or tuple(pair[1].shape) != spec.shape:
            got = "the end of the stream" if pair is None else f"{pair[0]!r} {list(pair[1].shape)}"
            msg = (
                f"the weights sent {got} where refit_info says {spec.name!r} "
                f"{list(spec.shape)}: the stream and its refit_info disagree"
            )
            raise RefitError(msg)
        # offsets are 512-byte aligned, so unpack_tensors returned views, never copies
        assert view.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()
        view.copy_(pair[1])


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]

"""The ``ipc`` checkpoint engine: colocated refit over our ZMQ transport (``shell.refit.zmq``).

Every member runs on one host (shared memory is a /dev/shm file on CPU, a CUDA IPC allocation
on a GPU). Rollout rank ``r`` pulls from policy rank ``r % T`` through that rank's sender number
``r // T``: a policy rank binds ``peers_per_rank`` senders at ``prepare()`` (before the topology
is known, NeMo-RL's order), so ``rollout_world_size <= train_world_size * peers_per_rank``; one
without peers iterates the stream in lockstep (sharded gathers stay collective) and sends
nothing. Refused by name: members on different hosts, different device types, more rollout ranks
than senders. A refit is the ZMQ protocol of docs/refit-protocol.md: BEGIN carries the manifest,
which each rollout rank checks against its ``refit_info`` before any byte.

By default (``engine_kwargs`` ``one_pass=None``, as ``RefitSender``'s) a refit is one-pass where
the rollout rank's target is an ``nn.Module``: at its first refit the rollout rank moves its
weights into one shared arena, registered with its BEGIN answer, and the policy rank casts each
tensor of ``send_weights``' stream straight into it (no staging, no copy on the rollout side;
``shell.refit.one_pass``); with several rollout peers each registers its own arena, and each
tensor is cast once into the first and copied into the others (``fan_out``). A ``load_weights``
callable cannot register, and ``one_pass=False`` forces it: such refits are staged, through two
ping-pong buffers of ``bucket_size`` bytes each (cast once into buffers every peer maps). Every
wait is bounded by ``timeout_s`` and a dead peer is a ``RefitTimeoutError`` naming the phase.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from policyworker.errors import RefitError
from policyworker.functional.buckets import IpcBucket, TensorSpec, align_up, plan_ipc_buckets
from policyworker.functional.wire.codec import max_message_bytes
from policyworker.shell.refit.checkpoint_engine.base import (
    CheckpointEngine,
    check_engine_kwargs,
    one_pass_option,
)
from policyworker.shell.refit.checkpoint_engine.fan_out import (
    FanOutExchange,
    staged_to_all,
    stream_one_pass_to_all,
    stream_to_all,
)
from policyworker.shell.refit.one_pass.sender import OnePassWriter, stream_one_pass
from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport
from policyworker.shell.refit.watchdog import check_timeout_s
from policyworker.shell.refit.weight_applier import specs_from
from policyworker.shell.refit.weight_stream import RefitSource
from policyworker.shell.refit.zmq import (
    CudaStaging,
    RefitServer,
    ShmStaging,
    ZmqIpcReceiver,
    ZmqIpcSender,
)
from policyworker.shell.refit.zmq.sender import Exchange

__all__ = ["IpcCheckpointEngine"]

BACKEND = "ipc"
OPTIONS = ("device", "timeout_s", "peers_per_rank", "one_pass")
DEFAULT_TIMEOUT_S = 120.0


class IpcCheckpointEngine(CheckpointEngine):
    """One colocated member's end. Options: ``device`` (default the current CUDA device, else
    CPU), ``timeout_s`` (every wait, default 120 s as NeMo-RL's ZMQ refit) and
    ``peers_per_rank`` (the most rollout ranks one policy rank feeds, default 1; pass the same
    value to every member) and ``one_pass`` (None, the default: one-pass wherever the rollout
    rank's target registers its memory, else staged; False: staged only, the weights left where
    they are; True: one-pass only). ``last_mode`` names the path the last ``send_weights`` took:
    "one-pass", "one-pass fan-out", "staged" or "staged fan-out"."""

    metadata_backend = BACKEND
    device_hint = "staging is /dev/shm on cpu, CUDA IPC on cuda"

    def __init__(self, *, bucket_size: int, **options: Any) -> None:
        check_engine_kwargs(BACKEND, options, OPTIONS)
        check_timeout_s("timeout_s", options.get("timeout_s", DEFAULT_TIMEOUT_S))
        peers = options.get("peers_per_rank", 1)
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
            msg = (
                f"engine_kwargs peers_per_rank {peers!r} must be an int >= 1 (the most rollout "
                "ranks one policy rank feeds: ceil(rollout_world_size / train_world_size))"
            )
            raise ValueError(msg)
        self.one_pass: bool | None = one_pass_option(options)
        self.bucket_size = bucket_size
        self.peers_per_rank = peers
        device = options.get("device")
        if device is None:
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        self.device = torch.device(device)
        self.timeout_s = float(options.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.senders: list[ZmqIpcSender] = []
        self.peers: list[int] | None = None  # this policy rank's rollout ranks, once joined
        self.address: str | None = None
        self._socket: ZmqIpcReceiver | None = None
        self._served: tuple[HFWeightReceiver, RefitServer] | None = None
        self._writers: list[OnePassWriter] = []  # a policy rank's, one per rollout peer
        self._specs: tuple[dict[str, Any], list[TensorSpec]] | None = None
        self._plan: tuple[list[TensorSpec], int, list[IpcBucket]] | None = None
        self.last_report: Any = None
        self.last_mode: str | None = None  # "one-pass", "staged" or "staged fan-out"

    def prepare(self) -> dict[str, Any]:
        """Bind ``peers_per_rank`` sockets and offer their addresses. ``prepare`` cannot tell
        the sides apart (NeMo-RL's signature), so a rollout rank binds them too and closes them
        when it joins."""
        while len(self.senders) < self.peers_per_rank:
            self.senders.append(ZmqIpcSender(rank=0))  # the rank is set when the policy joins
        addresses = [s.address for s in self.senders]
        return {
            "backend": BACKEND,
            "host": socket.gethostname(),
            "device": self.device.type,
            "address": addresses[0],
            "addresses": addresses,
        }

    def join_policy(self, worker_rank: int, train: int, rollout: int, metadata: list[Any]) -> None:
        self._check_members(train, rollout, metadata)
        senders = self._bound()
        if metadata[worker_rank]["addresses"] != [s.address for s in senders]:
            msg = (
                f"metadata[{worker_rank}] is not this policy rank's prepare() result: pass every "
                "rank's metadata in rank order, policy ranks first"
            )
            raise ValueError(msg)
        self.peers = list(range(worker_rank, rollout, train))
        for sender in senders[len(self.peers) :]:  # sockets no rollout rank connects to
            sender.close()
        self.senders = senders[: len(self.peers)]
        for sender in self.senders:
            sender.rank = worker_rank
        self._close_writers()
        self._writers = [OnePassWriter(worker_rank) for _ in self.senders]

    def _close_writers(self) -> None:
        for writer in self._writers:
            writer.close()  # unmaps its rollout rank's arena
        self._writers = []

    def _bound(self) -> list[ZmqIpcSender]:
        if not self.senders:
            msg = "the ipc engine has no socket: call prepare() on every member first"
            raise RefitError(msg)
        return self.senders

    def join_rollout(
        self, rollout_rank: int, train: int, rollout: int, metadata: list[Any]
    ) -> None:
        self._check_members(train, rollout, metadata)
        source = rollout_rank % train
        address = str(metadata[source]["addresses"][rollout_rank // train])
        if address != self.address:  # joined again without finalize: drop the old peer's socket
            self._close_receiver()
        self.address = address
        for sender in self.senders:  # a rollout rank serves nothing
            sender.close()
        self.senders = []

    def _check_members(self, train: int, rollout: int, metadata: list[Any]) -> None:
        """``ValueError`` unless every member is on this host, with enough sockets for every
        rollout rank (the backend tag and device types are ``check_metadata``'s)."""
        here = socket.gethostname()
        away = sorted({str(m.get("host")) for m in metadata} - {here})
        if away:
            msg = (
                f"the ipc checkpoint engine is colocated (shared memory / CUDA IPC on one host): "
                f"members on hosts {away} are not on this one ({here!r}); use the collective "
                "backend across hosts"
            )
            raise ValueError(msg)
        offered = min(len(m.get("addresses", ())) for m in metadata[:train])
        if rollout > train * offered:
            msg = (
                f"rollout_world_size {rollout} needs more ipc sockets than the {train} policy "
                f"ranks offer ({offered} each, engine_kwargs peers_per_rank): pass "
                f"peers_per_rank={-(-rollout // train)} to init_checkpoint_engine on every member"
            )
            raise ValueError(msg)

    async def send_weights(
        self,
        weights: Iterator[tuple[str, torch.Tensor]],
        *,
        refit_info: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """One refit to this rank's colocated rollout ranks; the report (None without peers)."""
        if self.peers is None:
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
            specs = self._specs_of(refit_info)
            with torch.no_grad():
                self.last_report = self._send(specs, _sources(weights, specs))
            return self.last_report
        finally:
            close = getattr(weights, "close", None)
            if close is not None:  # a generator left suspended would hold its gathers
                close()

    def _send(self, specs: list[TensorSpec], sources: Iterator[RefitSource]) -> dict[str, Any]:
        """One refit of ``specs``: one-pass where the rollout ranks registered, else staged."""
        per_buffer = align_up(self.bucket_size)
        cuda = self.device.type == "cuda"
        transport = "cuda" if cuda else "shm"

        def make_staging(nbytes: int) -> CudaStaging | ShmStaging:
            return CudaStaging(nbytes, self.device) if cuda else ShmStaging(nbytes)

        def staged(begun: Exchange | None = None) -> dict[str, Any]:
            self.last_mode = "staged"
            return self.senders[0].stream(
                specs,
                self._plan_of(specs, per_buffer),
                sources,
                make_staging=make_staging,
                buffer_bytes=per_buffer,
                timeout_s=self.timeout_s,
                transport=transport,
                begun=begun,
            )

        def staged_to_each(fan: FanOutExchange | None = None) -> dict[str, Any]:
            self.last_mode = "staged fan-out"
            plan = self._plan_of(specs, per_buffer)
            staging = {"make_staging": make_staging, "buffer_bytes": per_buffer}
            if fan is not None:  # every rollout rank ACKed a BEGIN it did not register for
                return staged_to_all(
                    fan, specs, plan, sources, **staging, transport=transport, begin=None
                )
            return stream_to_all(
                self.senders,
                specs,
                plan,
                sources,
                **staging,
                timeout_s=self.timeout_s,
                transport=transport,
                device=self.device,
            )

        fan_out = len(self.senders) > 1
        if self.one_pass is False:
            return staged_to_each() if fan_out else staged()
        self.last_mode = "one-pass fan-out" if fan_out else "one-pass"
        if fan_out:
            return stream_one_pass_to_all(
                self.senders,
                self._writers,
                specs,
                sources,
                timeout_s=self.timeout_s,
                transport=transport,
                device=self.device,
                or_staged=None if self.one_pass else staged_to_each,
            )
        return stream_one_pass(
            self.senders[0],
            self._writers[0],
            specs,
            sources,
            timeout_s=self.timeout_s,
            transport=transport,
            or_staged=None if self.one_pass else staged,
        )

    def _specs_of(self, refit_info: Mapping[str, Any]) -> list[TensorSpec]:
        """The manifest of ``refit_info``: the same object while it is unchanged, so the BEGIN
        frame, the bucket plan and the one-pass views are built once, not per refit."""
        info = dict(refit_info)
        if self._specs is None or self._specs[0] != info:
            self._specs = (info, specs_from(info))
        return self._specs[1]

    def _plan_of(self, specs: list[TensorSpec], per_buffer: int) -> list[IpcBucket]:
        if self._plan is None or self._plan[0] is not specs or self._plan[1] != per_buffer:
            self._plan = (specs, per_buffer, plan_ipc_buckets(specs, per_buffer))
        return self._plan[2]

    def receive_weights(self, receiver: HFWeightReceiver) -> RefitReport:
        """One refit from the colocated policy rank into ``receiver``."""
        if self.address is None:
            msg = "receive_weights needs init_rollout_process_group first (the policy's address)"
            raise RefitError(msg)
        if self._served is None or self._served[0] is not receiver:
            # the policy rank writes the registered arena (the weights move into it once, here)
            arena = receiver.register_one_pass(self.one_pass, where=self.address)
            cap = max_message_bytes(tuple(receiver.applier.manifest_specs()))
            if self._socket is not None:
                self._socket.close()
            self._socket = ZmqIpcReceiver(
                self.address, timeout_s=self.timeout_s, max_message_bytes=cap
            )
            self._served = (receiver, RefitServer(receiver.applier, one_pass=arena))
        assert self._socket is not None
        return self._socket.serve(self._served[1])

    def finalize(self) -> None:
        """Close the sockets and staging; the next ``prepare()`` binds a new address."""
        for sender in self.senders:
            sender.close()
        self._close_writers()
        self._close_receiver()
        self.senders, self.peers = [], None

    def _close_receiver(self) -> None:
        if self._socket is not None:
            self._socket.close()
        if self._served is not None:
            self._served[1].release_buffers()
        self._socket, self._served = None, None


def _sources(
    weights: Iterator[tuple[str, torch.Tensor]], specs: list[Any]
) -> Iterator[RefitSource]:
    for spec, (name, tensor) in zip(specs, weights, strict=False):
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            msg = (
                f"the weights sent {name!r} {list(tensor.shape)} where refit_info says "
                f"{spec.name!r} {list(spec.shape)}: the stream and its refit_info disagree"
            )
            raise RefitError(msg)
        yield RefitSource(name, tensor, spec.dtype)

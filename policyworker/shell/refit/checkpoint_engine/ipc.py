"""The ``ipc`` checkpoint engine: colocated refit over our ZMQ transport (``shell.refit.zmq``).

Rollout rank ``r`` shares a device (or a host, on CPU) with policy rank ``r`` and pulls from it
alone, so ``train_world_size >= rollout_world_size``; policy ranks without a rollout peer iterate
the stream in lockstep (sharded gathers stay collective) and send nothing. A refit is the ZMQ
protocol of docs/refit-protocol.md: BEGIN carries the manifest, which the rollout rank checks
against its ``refit_info`` before any byte; buckets travel through two ping-pong staging buffers
of ``bucket_size`` bytes each (CUDA IPC handles on a GPU, /dev/shm files on CPU); every wait is
bounded by ``timeout_s`` and a dead peer is a ``RefitTimeoutError`` naming the phase.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from policyworker.errors import RefitError
from policyworker.functional.buckets import align_up, plan_ipc_buckets
from policyworker.functional.wire.codec import max_message_bytes
from policyworker.shell.refit.checkpoint_engine.base import (
    CheckpointEngine,
    check_engine_kwargs,
    check_topology,
)
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

__all__ = ["IpcCheckpointEngine"]

BACKEND = "ipc"
OPTIONS = ("device", "timeout_s")
DEFAULT_TIMEOUT_S = 120.0


class IpcCheckpointEngine(CheckpointEngine):
    """One colocated member's end. Options: ``device`` (default the current CUDA device, else
    CPU) and ``timeout_s`` (every wait, default 120 s as NeMo-RL's ZMQ refit)."""

    def __init__(self, *, bucket_size: int, **options: Any) -> None:
        check_engine_kwargs(BACKEND, options, OPTIONS)
        check_timeout_s("timeout_s", options.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.bucket_size = bucket_size
        device = options.get("device")
        if device is None:
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        self.device = torch.device(device)
        self.timeout_s = float(options.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.sender: ZmqIpcSender | None = None
        self.has_peer: bool | None = None  # None until this policy rank joined
        self.address: str | None = None
        self._socket: ZmqIpcReceiver | None = None
        self._served: tuple[HFWeightReceiver, RefitServer] | None = None
        self.last_report: Any = None

    def prepare(self) -> dict[str, Any]:
        """Bind a socket and offer its address. ``prepare`` cannot tell the sides apart
        (NeMo-RL's signature), so a rollout rank binds one too and closes it when it joins."""
        if self.sender is None:
            self.sender = ZmqIpcSender(rank=0)  # the rank is set when the policy rank joins
        return {"backend": BACKEND, "address": self.sender.address}

    def init_policy_process_group(
        self,
        *,
        worker_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        check_topology(
            rank=worker_rank,
            side="policy",
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )
        _check_colocated(train_world_size, rollout_world_size)
        self.has_peer = worker_rank < rollout_world_size
        self._bound().rank = worker_rank
        if self.has_peer and metadata[worker_rank].get("address") != self._bound().address:
            msg = (
                f"metadata[{worker_rank}] is not this policy rank's prepare() result: pass every "
                "rank's metadata in rank order, policy ranks first"
            )
            raise ValueError(msg)

    def _bound(self) -> ZmqIpcSender:
        if self.sender is None:
            msg = "the ipc engine has no socket: call prepare() on every member first"
            raise RefitError(msg)
        return self.sender

    def init_rollout_process_group(
        self,
        *,
        rollout_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        check_topology(
            rank=rollout_rank,
            side="rollout",
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )
        _check_colocated(train_world_size, rollout_world_size)
        source = metadata[rollout_rank]
        if not isinstance(source, Mapping) or not source.get("address"):
            msg = (
                f"metadata[{rollout_rank}] must be policy rank {rollout_rank}'s ipc prepare() "
                f"result with its address; got {source!r}"
            )
            raise ValueError(msg)
        if self.sender is not None:  # a rollout rank serves nothing
            self.sender.close()
            self.sender = None
        self.address = str(source["address"])

    async def send_weights(
        self,
        weights: Iterator[tuple[str, torch.Tensor]],
        *,
        refit_info: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """One refit to this rank's colocated rollout rank; its report (None without a peer)."""
        if self.has_peer is None:
            msg = "send_weights needs prepare() and init_policy_process_group on every member first"
            raise RefitError(msg)
        try:
            if not self.has_peer:
                for _ in weights:  # the gathers are collective: take part, send nothing
                    pass
                return None
            if refit_info is None:  # the manifest must precede the bytes: hold the stream
                pairs = list(weights)
                refit_info = {name: (tensor.shape, tensor.dtype) for name, tensor in pairs}
                weights = iter(pairs)
            specs = specs_from(refit_info)
            per_buffer = align_up(self.bucket_size)
            cuda = self.device.type == "cuda"

            def make_staging(nbytes: int) -> CudaStaging | ShmStaging:
                return CudaStaging(nbytes, self.device) if cuda else ShmStaging(nbytes)

            with torch.no_grad():
                self.last_report = self._bound().stream(
                    specs,
                    plan_ipc_buckets(specs, per_buffer),
                    _sources(weights, specs),
                    make_staging=make_staging,
                    buffer_bytes=per_buffer,
                    timeout_s=self.timeout_s,
                    transport="cuda" if cuda else "shm",
                )
            return self.last_report
        finally:
            close = getattr(weights, "close", None)
            if close is not None:  # a generator left suspended would hold its gathers
                close()

    def receive_weights(self, receiver: HFWeightReceiver) -> RefitReport:
        """One refit from the colocated policy rank into ``receiver``."""
        if self.address is None:
            msg = "receive_weights needs init_rollout_process_group first (the policy's address)"
            raise RefitError(msg)
        if self._served is None or self._served[0] is not receiver:
            cap = max_message_bytes(tuple(receiver.applier.manifest_specs()))
            if self._socket is not None:
                self._socket.close()
            self._socket = ZmqIpcReceiver(
                self.address, timeout_s=self.timeout_s, max_message_bytes=cap
            )
            self._served = (receiver, RefitServer(receiver.applier))
        assert self._socket is not None
        return self._socket.serve(self._served[1])

    def finalize(self) -> None:
        """Close the sockets and staging; the next ``prepare()`` binds a new address."""
        if self.sender is not None:
            self.sender.close()
        if self._socket is not None:
            self._socket.close()
        if self._served is not None:
            self._served[1].release_buffers()
        self.sender, self._socket, self._served, self.has_peer = None, None, None, None


def _check_colocated(train_world_size: int, rollout_world_size: int) -> None:
    if train_world_size < rollout_world_size:
        msg = (
            f"the ipc checkpoint engine pairs rollout rank r with colocated policy rank r: "
            f"train_world_size {train_world_size} < rollout_world_size {rollout_world_size}; "
            "use the collective backend for more rollout ranks than policy ranks"
        )
        raise ValueError(msg)


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

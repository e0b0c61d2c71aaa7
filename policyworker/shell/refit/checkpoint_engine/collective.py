"""The ``collective`` checkpoint engine: our packed broadcast from policy rank 0.

The group is ``shell.refit.collective``'s (policy ranks ``0..T-1`` keep their rank, rollout rank
``i`` is ``T + i``; gloo on CPU, NCCL on CUDA), rendezvousing at policy rank 0's ``prepare()``
address. A refit is that module's: the manifest (names, shapes, dtypes) travels first and every
rollout rank checks it against its ``refit_info`` before any byte; buckets follow with
``num_buffers`` in flight; rollout ranks commit only when all applied everything. Every wait is
bounded (``timeout_s``, or ``refit_timeout_s`` with a watchdog); a lost peer is
``RefitPeerLostError`` on every survivor and leaves the group broken: ``finalize()``, then
``prepare()`` and ``init_*_process_group`` on every member build a new one.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from policyworker.errors import RefitError
from policyworker.shell.refit.checkpoint_engine.base import CheckpointEngine, check_engine_kwargs
from policyworker.shell.refit.collective import (
    DEFAULT_TIMEOUT_S,
    CollectiveRefit,
    CollectiveWeightReceiver,
    init_collective,
)
from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport
from policyworker.shell.refit.watchdog import check_timeout_s

__all__ = ["CollectiveCheckpointEngine"]

BACKEND = "collective"
OPTIONS = ("host", "device", "timeout_s", "refit_timeout_s", "num_buffers", "use_legacy_packing")


class CollectiveCheckpointEngine(CheckpointEngine):
    """One member's end of a collective checkpoint engine.

    Options (``engine_kwargs``): ``host`` (the address policy rank 0 serves the rendezvous on;
    default this node's address), ``device`` (default the current CUDA device, else CPU: every
    member must agree), ``timeout_s`` (every wait, default 600), ``refit_timeout_s`` (arms the
    watchdog), ``num_buffers`` and ``use_legacy_packing`` (as ``broadcast_weights_for_collective``).
    """

    metadata_backend = BACKEND
    device_hint = "gloo on cpu, nccl on cuda"

    def __init__(self, *, bucket_size: int, **options: Any) -> None:
        check_engine_kwargs(BACKEND, options, OPTIONS)
        check_timeout_s("timeout_s", options.get("timeout_s", DEFAULT_TIMEOUT_S))
        check_timeout_s("refit_timeout_s", options.get("refit_timeout_s"), none_means="no watchdog")
        self.bucket_size = bucket_size
        self.host: str = options.get("host") or _node_address()
        device = options.get("device")
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else "cpu"
            )
        self.device = torch.device(device)
        self.timeout_s = float(options.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.refit_timeout_s = options.get("refit_timeout_s")
        self.num_buffers = options.get("num_buffers")
        self.use_legacy_packing = bool(options.get("use_legacy_packing", False))
        self.port: int | None = None
        self.group: CollectiveRefit | None = None
        self._receiver: CollectiveWeightReceiver | None = None
        self.last_report: Any = None

    def prepare(self) -> dict[str, Any]:
        """This member's rendezvous offer; only policy rank 0's address is used."""
        self.port = _free_port(self.host)
        return {
            "backend": BACKEND,
            "host": self.host,
            "port": self.port,
            "device": self.device.type,
        }

    def join_policy(self, worker_rank: int, train: int, rollout: int, metadata: list[Any]) -> None:
        self._join(worker_rank, train, rollout, metadata)

    def join_rollout(
        self, rollout_rank: int, train: int, rollout: int, metadata: list[Any]
    ) -> None:
        self._join(train + rollout_rank, train, rollout, metadata)

    def _join(self, rank: int, train: int, rollout: int, metadata: list[Any]) -> None:
        if self.group is not None:
            msg = "this collective checkpoint engine already joined a group; call finalize() first"
            raise RefitError(msg)
        self.group = init_collective(
            str(metadata[0]["host"]),
            int(metadata[0]["port"]),
            train + rollout,
            train_world_size=train,
            rank=rank,
            device=self.device,
            timeout_s=self.timeout_s,
        )

    def _live_group(self, call: str, *, trainer: bool) -> CollectiveRefit:
        if self.group is None:
            msg = f"{call} needs a group: prepare() and init_*_process_group on every member first"
            raise RefitError(msg)
        if self.group.is_trainer != trainer:
            side = "policy" if self.group.is_trainer else "rollout"
            msg = f"{call} is not for a {side} rank (rank {self.group.rank} of the group)"
            raise RefitError(msg)
        return self.group

    async def send_weights(
        self,
        weights: Iterator[tuple[str, torch.Tensor]],
        *,
        refit_info: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One refit from this policy rank (rank 0 sends; others iterate in lockstep).

        Returns the broadcast's report (also kept as ``last_report``).
        """
        group = self._live_group("send_weights", trainer=True)
        try:
            if refit_info is None:  # the manifest must precede the bytes: hold the stream
                pairs = list(weights)
                refit_info = {name: (tensor.shape, tensor.dtype) for name, tensor in pairs}
                weights = iter(pairs)
            with torch.no_grad():  # the bucket casts record no graph, whatever the caller's mode
                self.last_report = group.broadcast_weights(
                    weights,
                    refit_info=refit_info,
                    buffer_size_bytes=self.bucket_size,
                    num_buffers=self.num_buffers,
                    use_legacy_packing=self.use_legacy_packing,
                    refit_timeout_s=self.refit_timeout_s,
                )
        finally:
            close = getattr(weights, "close", None)
            if close is not None:  # a generator left suspended would hold its gathers
                close()
        return self.last_report

    def receive_weights(self, receiver: HFWeightReceiver) -> RefitReport:
        """One refit into ``receiver``; committed only when every rollout rank applied it."""
        group = self._live_group("receive_weights", trainer=False)
        if self._receiver is None or self._receiver.receiver is not receiver:
            self._receiver = CollectiveWeightReceiver(receiver, group=group)
        return self._receiver.receive(refit_timeout_s=self.refit_timeout_s)

    def finalize(self) -> None:
        """Leave the group (a broken one stays parked, see ``collective.group``)."""
        if self.group is not None:
            self.group.close()
        self.group, self._receiver, self.port = None, None, None


def _node_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

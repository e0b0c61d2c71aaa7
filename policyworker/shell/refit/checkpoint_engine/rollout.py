"""``CheckpointEngineRollout``: the rollout side of checkpoint-engine refits, for any engine.

It hosts one ``HFWeightReceiver``-style target (an HF ``nn.Module``, a vLLM-style
``load_weights(iterable)`` callable, or an ``HFWeightReceiver``) and answers the calls NeMo-RL's
weight synchronizer makes on a generation worker, with the same names and arguments:
``checkpoint_engine_total_memory_bytes``, ``init_checkpoint_engine(backend, bucket_size_bytes,
engine_kwargs)`` (idempotent), ``prepare_checkpoint_engine`` (adds ``rank``),
``init_checkpoint_engine_process_group(rank_prefix, train_world_size, rollout_world_size,
metadata)``, ``update_weights_from_checkpoint_engine`` and ``finalize_checkpoint_engine``; or all
of them through ``checkpoint_engine_rpc(checkpoint_method, method_args)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from policyworker.errors import RefitError
from policyworker.shell.refit.checkpoint_engine.registry import (
    ensure_checkpoint_engine,
    forward_to_engine,
    total_memory_bytes,
)
from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport

__all__ = ["CheckpointEngineRollout"]

LIFECYCLE = (
    "checkpoint_engine_total_memory_bytes",
    "init_checkpoint_engine",
    "prepare_checkpoint_engine",
    "init_checkpoint_engine_process_group",
    "update_weights_from_checkpoint_engine",
    "finalize_checkpoint_engine",
)


class CheckpointEngineRollout:
    """One rollout rank: ``target`` receives every refit, checked against ``refit_info``.

    ``rank`` is this rank's index inside its engine (tensor/pipeline rank 0 .. n-1); the
    driver's ``rank_prefix`` (the engine's first rollout rank) is added to it at
    ``init_checkpoint_engine_process_group``. ``atomic=True`` stages a whole refit and writes it
    only when complete, so a failed refit leaves the previous weights serving. With the ``ipc``
    backend an ``nn.Module`` target moves its weights into a shared arena at its first refit,
    which the policy rank then writes directly (one-pass; ``engine_kwargs`` ``one_pass=False``
    keeps them in place and stages).
    """

    def __init__(
        self,
        target: HFWeightReceiver | nn.Module | Callable[..., Any],
        *,
        refit_info: Mapping[str, Any] | None,
        atomic: bool = False,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            msg = f"rank {rank!r} must be an int >= 0 (this rank's index inside its engine)"
            raise ValueError(msg)
        self.receiver = HFWeightReceiver.socketless(target, refit_info=refit_info, atomic=atomic)
        self.rank = rank
        self.device = torch.device(device)
        self.checkpoint_engine: Any = None
        self.backend: str | None = None
        self.last_report: RefitReport | None = None

    def checkpoint_engine_total_memory_bytes(self) -> int:
        return total_memory_bytes(self.device)

    def init_checkpoint_engine(
        self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any] | None
    ) -> None:
        self.checkpoint_engine = ensure_checkpoint_engine(
            self.checkpoint_engine,
            self.backend,
            backend=backend,
            bucket_size_bytes=bucket_size_bytes,
            engine_kwargs=engine_kwargs,
        )
        self.backend = backend

    def prepare_checkpoint_engine(self) -> Any:
        metadata = self._engine("prepare_checkpoint_engine").prepare()
        return {**metadata, "rank": self.rank} if isinstance(metadata, dict) else metadata

    def init_checkpoint_engine_process_group(
        self, rank_prefix: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        if isinstance(rank_prefix, bool) or not isinstance(rank_prefix, int) or rank_prefix < 0:
            msg = (
                f"rank_prefix {rank_prefix!r} must be an int >= 0 (the engine's first rollout rank)"
            )
            raise ValueError(msg)
        self._engine("init_checkpoint_engine_process_group").init_rollout_process_group(
            rollout_rank=rank_prefix + self.rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )

    def update_weights_from_checkpoint_engine(self) -> bool:
        """Receive one refit into the target; True when it was applied (errors raise, named)."""
        self.last_report = self.receive_weights()
        return True

    def receive_weights(self) -> RefitReport:
        """One refit into the target; the receiver's report."""
        return self._engine("update_weights_from_checkpoint_engine").receive_weights(self.receiver)

    def finalize_checkpoint_engine(self) -> None:
        if self.checkpoint_engine is not None:
            self.checkpoint_engine.finalize()

    def checkpoint_engine_rpc(
        self, checkpoint_method: str, method_args: tuple[Any, ...] = ()
    ) -> Any:
        """NeMo-RL's generation-side dispatch: a lifecycle method by name, positional args."""
        if checkpoint_method in LIFECYCLE:
            return getattr(self, checkpoint_method)(*method_args)
        return forward_to_engine(
            self._engine(checkpoint_method), checkpoint_method, LIFECYCLE, args=method_args
        )

    def _engine(self, call: str) -> Any:
        if self.checkpoint_engine is None:
            msg = (
                f"{call} needs a checkpoint engine: call init_checkpoint_engine(backend, ...) first"
            )
            raise RefitError(msg)
        return self.checkpoint_engine

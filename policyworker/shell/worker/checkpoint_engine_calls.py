"""NeMo-RL's checkpoint-engine refit on the policy worker: ``checkpoint_engine_rpc`` and
``send_weights_via_checkpoint_engine``, with the names, arguments and returns of NeMo-RL's
``PolicyCheckpointEngineMixin`` and ``AutomodelCheckpointEngineSendMixin``.

``CheckpointEngineCalls`` is a mixin of ``PolicyWorker`` (it reads ``self.state`` and calls the
worker's ``_checkpoint_engine_params``, ``move_to_cuda`` and ``move_to_cpu``). Every call is
collective over the worker's process group, as every refit: all policy ranks make it together.
The backends live in ``shell/refit/checkpoint_engine``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from policyworker.errors import RefitError
from policyworker.shell.refit.checkpoint_engine.registry import (
    ensure_checkpoint_engine,
    forward_to_engine,
    is_ours,
    total_memory_bytes,
)
from policyworker.shell.refit.weight_stream import refit_info

__all__ = ["CheckpointEngineCalls"]

LIFECYCLE = (
    "checkpoint_engine_total_memory_bytes",
    "init_checkpoint_engine",
    "prepare_checkpoint_engine",
    "init_checkpoint_engine_process_group",
    "send_weights_via_checkpoint_engine",
    "finalize_checkpoint_engine",
)
_INIT_KEYS = ("backend", "bucket_size_bytes", "engine_kwargs")


class CheckpointEngineCalls:
    """The policy side of checkpoint-engine refits (NeMo-RL's lifecycle, one engine per worker)."""

    state: Any
    checkpoint_engine: Any = None
    _checkpoint_engine_backend: str | None = None

    # The worker's own methods this mixin drives.
    _checkpoint_engine_params: Any
    move_to_cuda: Any
    move_to_cpu: Any

    async def checkpoint_engine_rpc(
        self, checkpoint_method: str, method_kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        """One lifecycle call by name, as NeMo-RL's weight synchronizer makes it:

        ``checkpoint_engine_total_memory_bytes`` -> int; ``init_checkpoint_engine`` (backend,
        bucket_size_bytes, engine_kwargs; a repeat is a no-op) -> None;
        ``prepare_checkpoint_engine`` -> the engine's metadata plus ``rank``;
        ``init_checkpoint_engine_process_group`` (train_world_size, rollout_world_size,
        metadata) -> None; ``send_weights_via_checkpoint_engine`` (kv_scales) -> None;
        ``finalize_checkpoint_engine`` -> None; any other name is the engine's own method.
        """
        kwargs = dict(method_kwargs or {})
        if checkpoint_method == "checkpoint_engine_total_memory_bytes":
            return total_memory_bytes(self.state.device)
        if checkpoint_method == "init_checkpoint_engine":
            missing = [k for k in _INIT_KEYS if k not in kwargs]
            if missing or set(kwargs) - set(_INIT_KEYS):
                msg = (
                    f"init_checkpoint_engine takes exactly {list(_INIT_KEYS)}; got "
                    f"{sorted(kwargs)} (missing {missing})"
                )
                raise ValueError(msg)
            self.checkpoint_engine = ensure_checkpoint_engine(
                self.checkpoint_engine, self._checkpoint_engine_backend, **kwargs
            )
            self._checkpoint_engine_backend = kwargs["backend"]
            return None
        if checkpoint_method == "finalize_checkpoint_engine":
            if self.checkpoint_engine is not None:
                self.checkpoint_engine.finalize()
            return None
        if checkpoint_method == "send_weights_via_checkpoint_engine":
            return await self.send_weights_via_checkpoint_engine(**kwargs)
        engine = self._require_checkpoint_engine(checkpoint_method)
        rank = self.state.parallel.rank
        if checkpoint_method == "prepare_checkpoint_engine":
            metadata = engine.prepare()
            return {**metadata, "rank": rank} if isinstance(metadata, dict) else metadata
        if checkpoint_method == "init_checkpoint_engine_process_group":
            return engine.init_policy_process_group(worker_rank=rank, **kwargs)
        return forward_to_engine(engine, checkpoint_method, LIFECYCLE, kwargs=kwargs)

    async def send_weights_via_checkpoint_engine(
        self, kv_scales: dict[str, float] | None = None
    ) -> None:
        """One refit through the checkpoint engine: ``_checkpoint_engine_params()`` (HF names,
        refit dtypes, LoRA merged, draft tensors after the policy's) streamed in buckets.

        Raises:
            NotImplementedError: ``kv_scales`` given (no FP8 KV-cache path here).
            RefitError: no engine yet, or the transfer failed (the backend's named error).
        """
        weights = _Drainable(self._checkpoint_engine_weight_iterator(kv_scales=kv_scales))
        engine = self._require_checkpoint_engine("send_weights_via_checkpoint_engine")
        self.state.require_running("send_weights_via_checkpoint_engine")
        self.state.reshard()
        info = (
            refit_info(self.state.model, self.state.dtype, self.state.draft.model)
            if is_ours(engine)
            else None
        )
        parallel = self.state.parallel
        self._prepare_checkpoint_engine_weight_send()
        try:
            with torch.no_grad():
                if info is None:  # a foreign (NeMo-RL) engine takes the stream alone
                    await engine.send_weights(weights)
                else:
                    await engine.send_weights(weights, refit_info=info)
                weights.drain()  # an engine that sends nothing from this rank may not iterate
        except BaseException:
            # The other policy ranks wait in this rank's next weight gather: finish them, and
            # tell every rank, so all of them raise instead of hanging.
            with contextlib.suppress(Exception), torch.no_grad():
                weights.drain()
                parallel.all_reduce_int(1, op="max", axis="world")
            raise
        finally:
            self._finalize_checkpoint_engine_weight_send()
        if parallel.all_reduce_int(0, op="max", axis="world"):
            msg = (
                f"checkpoint-engine send failed on another policy rank (rank {parallel.rank} "
                "finished its part); see that rank's error, then finalize_checkpoint_engine and "
                "set the engine up again on every rank"
            )
            raise RefitError(msg)

    def _checkpoint_engine_weight_iterator(
        self, kv_scales: dict[str, float] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if kv_scales is not None:
            msg = (
                "FP8 kvcache is not supported by this worker's checkpoint-engine refit (no "
                f"kv-scale path); got kv_scales={type(kv_scales).__name__}, pass None"
            )
            raise NotImplementedError(msg)
        return self._checkpoint_engine_params()

    def _prepare_checkpoint_engine_weight_send(self) -> None:
        if self.state.cfg.dtensor_cfg.cpu_offload:
            warnings.warn(
                "cpu_offload adds an onload/offload cycle during non-colocated checkpoint-engine "
                "refit (the model moves to the device and back); disable it unless device memory "
                "requires it",
                stacklevel=3,
            )
            self.move_to_cuda(self.state.model)

    def _finalize_checkpoint_engine_weight_send(self) -> None:
        if self.state.cfg.dtensor_cfg.cpu_offload:
            self.move_to_cpu(self.state.model)

    def _require_checkpoint_engine(self, call: str) -> Any:
        if self.checkpoint_engine is None:
            msg = (
                f"{call} needs a checkpoint engine: call checkpoint_engine_rpc("
                "'init_checkpoint_engine', {'backend': ..., 'bucket_size_bytes': ..., "
                "'engine_kwargs': {...}}) first"
            )
            raise RefitError(msg)
        return self.checkpoint_engine


class _Drainable:
    """The weight stream as an engine sees it (no ``close``: an engine that stops early leaves
    the rest to ``drain``, so every policy rank finishes the same sequence of gathers)."""

    def __init__(self, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._it = it

    def __iter__(self) -> _Drainable:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._it)

    def drain(self) -> None:
        for _ in self._it:
            pass

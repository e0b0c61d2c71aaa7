"""SGLang colocated refit: per-dtype flattened buckets through ``update_weights_from_tensor``.

The payload (SGLang's ``load_format="flattened_bucket"``, one dtype per bucket, one per engine
TP rank) is built, read and safely unpickled in ``sglang_payload``; its names stay importable
from here.

Trainer rank ``r`` belongs to engine ``r // n`` (``n = num_gpus_per_engine``); the engine's
first rank gathers its ranks' payloads (gloo subgroup, world > 1) and calls the engine once per
dtype bucket, awaiting each call (sync result, ``.result()``, awaitable or Ray ObjectRef) so the
tensors it points at stay alive until copied and a failure surfaces at once. Every bucket tensor
is fresh (never reused: SGLang does not sync before replying). The last call passes
``flush_cache=True``; every call carries the new ``weight_version``.

``SGLangReceiverAdapter`` is a local engine stand-in (tests, single-process setups): it rebuilds
the tensors from a payload and applies them through an ``HFWeightReceiver``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from policyworker.errors import RefitError
from policyworker.functional.dtypes import precision_dtype
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sglang.payload import (
    LOAD_FORMAT,
    NamedTensors,
    deserialize_payload,
    flatten_bucket,
    plan_sglang_chunks,
    serialize_payload,
    unflatten_bucket,
)

__all__ = [
    "SGLangColocatedSender",
    "SGLangReceiverAdapter",
    "deserialize_payload",
    "flatten_bucket",
    "plan_sglang_chunks",
    "serialize_payload",
    "unflatten_bucket",
    "update_weights_to_sglang_colocated",
]


# ----------------------------------------------------------------------------- sender


# How long one engine call (a Ray ObjectRef) may take before the refit fails.
ENGINE_CALL_TIMEOUT_S = 600.0


def _call_engine(engine: Any, method: str, **kwargs: Any) -> Any:
    """Call ``engine.<method>(**kwargs)``; a Ray actor handle's method is called with
    ``.remote(...)`` (a direct call raises in Ray), anything else directly."""
    bound = getattr(engine, method)
    remote = getattr(bound, "remote", None)
    return remote(**kwargs) if callable(remote) else bound(**kwargs)


def _is_ray_object_ref(result: Any) -> bool:
    kind = type(result)
    return kind.__name__ == "ObjectRef" and kind.__module__.split(".")[0] == "ray"


def _resolve(result: Any) -> Any:
    """Await an engine call's result: sync value, Ray ObjectRef (``ray.get`` with a timeout),
    ``.result()`` future, or awaitable."""
    if _is_ray_object_ref(result):
        import ray

        return ray.get(result, timeout=ENGINE_CALL_TIMEOUT_S)
    if inspect.isawaitable(result):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(_await(result))
        msg = (
            "the engine returned an awaitable inside a running event loop; call this from a "
            "worker thread"
        )
        raise RuntimeError(msg)
    if hasattr(result, "result") and callable(result.result):
        return result.result()
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _check_reply(reply: Any, *, engine: int, call: int) -> None:
    """SGLang answers ``{"success", "message"}`` (or a tuple); a falsy success is a failure."""
    success, message = True, ""
    if isinstance(reply, Mapping):
        success, message = bool(reply.get("success", True)), str(reply.get("message", ""))
    elif isinstance(reply, tuple) and reply and isinstance(reply[0], bool):
        success, message = reply[0], str(reply[1]) if len(reply) > 1 else ""
    if not success:
        msg = (
            f"SGLang engine {engine} rejected weight update call {call}: "
            f"{message or 'success=False'}"
        )
        raise RefitError(msg)


def update_weights_to_sglang_colocated(
    named_tensors: NamedTensors,
    *,
    rollout_engines: Sequence[Any],
    buffer_size_bytes: int,
    target_precision: str = "bf16",
    sglang_quantization_cfg: Any = None,
    rank: int = 0,
    world_size: int = 1,
    num_gpus_per_engine: int | None = None,
    weight_version: int = 1,
    gather: Callable[[bytes], list[bytes] | None] | None = None,
) -> dict[str, Any]:
    """Push one refit into SGLang engines (every trainer rank calls this together).

    ``named_tensors`` are sent as given (the caller casts them, e.g. ``params_generator(model,
    precision_dtype(target_precision))``); ``target_precision`` is checked here so a bad value
    fails before anything is sent. ``gather(payload) -> list | None`` collects the payloads of
    this rank's engine group on its first rank (None elsewhere); it is required when
    ``num_gpus_per_engine > 1``.

    Returns ``{"weight_version", "num_chunks", "num_calls", "num_bytes"}`` (calls on this rank).

    Raises:
        ValueError: bad arguments, or ``sglang_quantization_cfg`` given (unsupported).
        RefitError: an engine call failed or answered ``success=False`` (raised at that call).
    """
    if sglang_quantization_cfg is not None:
        msg = (
            "sglang_quantization_cfg is not supported by this worker (no on-the-fly quantization "
            "of refit "
            "weights); pass None and let the engine quantize at load"
        )
        raise ValueError(msg)
    precision_dtype(target_precision)
    if (
        isinstance(buffer_size_bytes, bool)
        or not isinstance(buffer_size_bytes, int)
        or buffer_size_bytes <= 0
    ):
        msg = f"buffer_size_bytes {buffer_size_bytes!r} must be an int > 0 (bytes per chunk)"
        raise ValueError(msg)
    if num_gpus_per_engine is None:
        msg = "call set_rollout_num_gpus_per_engine(n) before update_weights_to_sglang_colocated"
        raise ValueError(msg)
    _check_layout(world_size, num_gpus_per_engine, len(rollout_engines))
    if num_gpus_per_engine > 1 and gather is None:
        msg = (
            f"num_gpus_per_engine={num_gpus_per_engine} needs a gather over the engine's trainer "
            "ranks"
        )
        raise ValueError(msg)
    engine_index = rank // num_gpus_per_engine
    is_src = rank % num_gpus_per_engine == 0
    engine = rollout_engines[engine_index]
    num_chunks = num_calls = num_bytes = 0
    held: list[tuple[str, torch.Tensor]] | None = None  # one call held back: the last one flushes

    def call(group: list[tuple[str, torch.Tensor]], *, last: bool) -> None:
        nonlocal num_calls
        payload = flatten_bucket(group)  # fresh per call: SGLang may still read it after replying
        data = serialize_payload(payload)
        per_rank = gather(data) if gather is not None and num_gpus_per_engine > 1 else [data]
        if is_src:
            assert per_rank is not None
            reply = _resolve(
                _call_engine(
                    engine,
                    "update_weights_from_tensor",
                    serialized_named_tensors=per_rank,
                    load_format=LOAD_FORMAT,
                    flush_cache=last,
                    weight_version=str(weight_version),
                )
            )
            _check_reply(reply, engine=engine_index, call=num_calls)
            num_calls += 1
        del payload, data, per_rank
        if group[0][1].is_cuda:
            torch.cuda.ipc_collect()

    for chunk in _iter_chunks(named_tensors, buffer_size_bytes):  # lazy: one chunk of tensors alive
        num_chunks += 1
        num_bytes += sum(t.numel() * t.element_size() for _, t in chunk)
        for dtype in dict.fromkeys(t.dtype for _, t in chunk):
            if held is not None:
                call(held, last=False)
            held = [(n, t) for n, t in chunk if t.dtype == dtype]
    if held is not None:
        call(held, last=True)
    return {
        "weight_version": weight_version,
        "num_chunks": num_chunks,
        "num_calls": num_calls,
        "num_bytes": num_bytes,
    }


def _iter_chunks(
    named_tensors: NamedTensors, buffer_size_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Streaming ``plan_sglang_chunks``: yields each chunk as soon as it is closed."""
    current: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if current and used + size >= buffer_size_bytes:
            yield current
            current, used = [], 0
        current.append((name, tensor))
        used += size
    if current:
        yield current


def _check_layout(
    world_size: int, num_gpus_per_engine: int, num_engines: int | None = None
) -> None:
    if (
        not isinstance(num_gpus_per_engine, int)
        or num_gpus_per_engine < 1
        or world_size % num_gpus_per_engine
    ):
        msg = (
            f"num_gpus_per_engine {num_gpus_per_engine!r} must be a positive int dividing the "
            "trainer world size "
            f"{world_size} (engine i owns trainer ranks [i*n, (i+1)*n))"
        )
        raise ValueError(msg)
    if num_engines is not None and num_engines != world_size // num_gpus_per_engine:
        msg = (
            f"rollout_engines has {num_engines} engine(s) but world size {world_size} / "
            "num_gpus_per_engine "
            f"{num_gpus_per_engine} = {world_size // num_gpus_per_engine}; pass one handle per "
            "engine"
        )
        raise ValueError(msg)


class SGLangColocatedSender:
    """Worker-side state: engine layout, per-engine gloo groups, and the weight version."""

    def __init__(self, *, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.num_gpus_per_engine: int | None = None
        self.weight_version = 0
        self._group: Any = None

    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        """Engine i owns trainer ranks ``[i*n, (i+1)*n)``; builds the gather groups (collective)."""
        _check_layout(self.world_size, num_gpus_per_engine)
        self.num_gpus_per_engine = num_gpus_per_engine
        self._group = None
        if num_gpus_per_engine > 1:
            import torch.distributed as dist

            for start in range(
                0, self.world_size, num_gpus_per_engine
            ):  # every rank creates every group
                group = dist.new_group(
                    list(range(start, start + num_gpus_per_engine)), backend="gloo"
                )
                if start <= self.rank < start + num_gpus_per_engine:
                    self._group = group

    def _gather(self, data: bytes) -> list[bytes] | None:
        import torch.distributed as dist

        assert self.num_gpus_per_engine is not None
        src = self.rank - self.rank % self.num_gpus_per_engine
        out: list[Any] | None = [None] * self.num_gpus_per_engine if self.rank == src else None
        dist.gather_object(data, out, dst=src, group=self._group)
        return out

    def update_weights(
        self,
        named_tensors: NamedTensors,
        *,
        rollout_engines: Sequence[Any],
        buffer_size_bytes: int,
        target_precision: str = "bf16",
        sglang_quantization_cfg: Any = None,
    ) -> dict[str, Any]:
        """One refit at version ``weight_version + 1`` (kept only if every call succeeded).

        Consumes ``named_tensors`` and closes it (a generator) on every exit, under
        ``torch.no_grad()``: the caller's grad mode is as it was, whatever happens."""
        try:
            with torch.no_grad():
                report = self._update(
                    named_tensors,
                    rollout_engines,
                    buffer_size_bytes,
                    target_precision,
                    sglang_quantization_cfg,
                )
        finally:
            close = getattr(named_tensors, "close", None)
            if close is not None:
                close()
        self.weight_version += 1
        return report

    def _update(
        self,
        named_tensors: NamedTensors,
        rollout_engines: Sequence[Any],
        buffer_size_bytes: int,
        target_precision: str,
        sglang_quantization_cfg: Any,
    ) -> dict[str, Any]:
        return update_weights_to_sglang_colocated(
            named_tensors,
            rollout_engines=rollout_engines,
            buffer_size_bytes=buffer_size_bytes,
            target_precision=target_precision,
            sglang_quantization_cfg=sglang_quantization_cfg,
            rank=self.rank,
            world_size=self.world_size,
            num_gpus_per_engine=self.num_gpus_per_engine,
            weight_version=self.weight_version + 1,
            gather=self._gather if self._group is not None else None,
        )


# ----------------------------------------------------------------------------- local engine


class SGLangReceiverAdapter:
    """A local stand-in for an SGLang engine: applies ``flattened_bucket`` payloads to a HF model.

    Calls between two ``flush_cache=True`` calls form one refit (validated against
    ``refit_info``; ``atomic`` / ``stale`` semantics of ``HFWeightReceiver``); the refit commits
    on the ``flush_cache=True`` call and records its ``weight_version``. Replies like SGLang:
    ``{"success": bool, "message": str}``.
    """

    def __init__(
        self,
        target: HFWeightReceiver | nn.Module | Callable[..., Any],
        *,
        refit_info: Mapping[str, Any] | None = None,
        atomic: bool = False,
        tp_rank: int = 0,
    ) -> None:
        self.receiver = HFWeightReceiver.socketless(target, refit_info=refit_info, atomic=atomic)
        self.tp_rank = tp_rank
        self.weight_version: str | None = None
        self.num_calls = 0
        self._open = False

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        self.num_calls += 1
        try:
            if load_format != LOAD_FORMAT:
                msg = (
                    f"load_format {load_format!r} is not supported by this adapter; use "
                    f"{LOAD_FORMAT!r}"
                )
                raise RefitError(msg)
            pairs = unflatten_bucket(deserialize_payload(serialized_named_tensors[self.tp_rank]))
            if not self._open:
                self.receiver.begin_refit(self.receiver.refit_info)
                self._open = True
            self.receiver.apply_batch(pairs)
            if flush_cache:
                self._open = False
                self.receiver.commit_refit(num_buckets=self.num_calls)
                self.num_calls = 0
                self.weight_version = weight_version
        except (RefitError, ValueError, IndexError) as exc:
            if self._open:
                self.receiver.abort_refit(str(exc))
            self._open = False
            self.num_calls = 0
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        return {"success": True, "message": "Succeeded to update parameter online."}

"""The checkpoint-engine backends by name, and the idempotent creation both sides share.

``collective``, ``ipc`` and ``nixl`` are ours; ``nixl`` is offered only where the ``nixl``
package imports in a supported version; a ``"module:ClassName"`` path loads any other engine
built as ``cls(bucket_size=..., **engine_kwargs)`` (NeMo-RL's convention), NeMo-RL's own NIXL
engine included (``NEMO_RL_NIXL``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.shell.refit.checkpoint_engine.base import CheckpointEngine

__all__ = [
    "BACKENDS",
    "NEMO_RL_NIXL",
    "create_checkpoint_engine",
    "ensure_checkpoint_engine",
    "forward_to_engine",
    "is_ours",
    "known_backends",
    "total_memory_bytes",
]

_HERE = "policyworker.shell.refit.checkpoint_engine"
BACKENDS: Mapping[str, str] = {
    "collective": f"{_HERE}.collective:CollectiveCheckpointEngine",
    "ipc": f"{_HERE}.ipc:IpcCheckpointEngine",
    "nixl": f"{_HERE}.nixl:NixlCheckpointEngine",
}
# NeMo-RL's own NIXL engine, by its path (needs nemo_rl installed)
NEMO_RL_NIXL = "nemo_rl.utils.checkpoint_engines.nixl:NIXLCheckpointEngine"


def _nixl_problem() -> str | None:
    """Why the nixl backend cannot run here, or None when it can."""
    from policyworker.shell.refit.checkpoint_engine.nixl_link import nixl_problem  # noqa: PLC0415

    return nixl_problem()


def known_backends() -> list[str]:
    """The backend names that can be created in this process."""
    return [name for name in BACKENDS if name != "nixl" or _nixl_problem() is None]


def create_checkpoint_engine(
    backend: str, *, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any] | None
) -> Any:
    """A new engine of ``backend`` with buckets of ``bucket_size_bytes``.

    Raises:
        ValueError: an unknown backend (the known ones listed), ``nixl`` where it cannot run
            (the reason named), a bucket size that is not a positive int, or an engine option
            the backend does not take.
    """
    if isinstance(bucket_size_bytes, bool) or not isinstance(bucket_size_bytes, int):
        msg = f"bucket_size_bytes {bucket_size_bytes!r} must be a positive int (bytes per bucket)"
        raise ValueError(msg)
    if bucket_size_bytes < 1:
        msg = f"bucket_size_bytes {bucket_size_bytes!r} must be >= 1 (bytes per bucket)"
        raise ValueError(msg)
    if engine_kwargs is not None and not isinstance(engine_kwargs, Mapping):
        msg = (
            "engine_kwargs must be a mapping of the backend's options or None, got "
            f"{engine_kwargs!r}"
        )
        raise ValueError(msg)
    if not isinstance(backend, str) or (backend not in BACKENDS and ":" not in backend):
        msg = (
            f"unknown checkpoint-engine backend {backend!r}; known here: {known_backends()} "
            "(nixl needs the nixl package), or a 'module:ClassName' path to an engine class "
            f"(NeMo-RL's NIXL engine: {NEMO_RL_NIXL!r})"
        )
        raise ValueError(msg)
    if backend == "nixl" and (problem := _nixl_problem()) is not None:
        msg = (
            f"checkpoint-engine backend 'nixl' is unavailable: {problem}; known here: "
            f"{known_backends()}"
        )
        raise ValueError(msg)
    module_name, class_name = BACKENDS.get(backend, backend).split(":", 1)
    engine_cls = getattr(importlib.import_module(module_name), class_name, None)
    if not isinstance(engine_cls, type):
        msg = f"checkpoint-engine backend {backend!r}: {module_name} has no class {class_name!r}"
        raise ValueError(msg)
    return engine_cls(bucket_size=bucket_size_bytes, **dict(engine_kwargs or {}))


def ensure_checkpoint_engine(
    current: Any,
    current_backend: str | None,
    *,
    backend: str,
    bucket_size_bytes: int,
    engine_kwargs: Mapping[str, Any] | None,
) -> Any:
    """``current`` if one of ``backend`` exists (a repeated init is a no-op), else a new engine.

    Raises:
        ValueError: ``current`` is another backend's engine (one engine per process for life).
    """
    if current is None:
        return create_checkpoint_engine(
            backend, bucket_size_bytes=bucket_size_bytes, engine_kwargs=engine_kwargs
        )
    if backend != current_backend:
        msg = (
            f"init_checkpoint_engine(backend={backend!r}): this process already has a "
            f"{current_backend!r} checkpoint engine (one per process); pass {current_backend!r} "
            "or start a new process"
        )
        raise ValueError(msg)
    return current


def total_memory_bytes(device: torch.device) -> int:
    """The device's total memory (NeMo-RL sizes buckets from it); the host's RAM on CPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def is_ours(engine: Any) -> bool:
    """Whether ``engine`` takes our ``refit_info`` / ``receive_weights`` extensions."""
    return isinstance(engine, CheckpointEngine)


def forward_to_engine(
    engine: Any,
    method: str,
    lifecycle: Sequence[str],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Call a backend's own public ``engine.<method>``; ValueError naming what exists."""
    call = getattr(engine, method, None) if not method.startswith("_") else None
    if not callable(call):
        public = sorted(
            n for n in dir(engine) if not n.startswith("_") and callable(getattr(engine, n))
        )
        msg = (
            f"checkpoint_engine_rpc: unknown method {method!r}; lifecycle calls: "
            f"{sorted(lifecycle)}; the {type(engine).__name__} engine also has {public}"
        )
        raise ValueError(msg)
    return call(*args, **dict(kwargs or {}))

"""Optimizer and LR scheduler from NeMo-RL style config sections.

`optimizer`: `{name: "torch.optim.AdamW", kwargs: {...}}` over trainable params only; string
kwargs values starting with "torch." are resolved to torch attributes (e.g. dtypes).
`scheduler`: absent -> constant `LambdaLR(1)`; `{name, kwargs}` -> that scheduler; a list of
such entries plus one `{milestones: [...]}` -> `SequentialLR`. The worker steps it once per
`train()` call.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["build_optimizer", "build_scheduler", "resolve_dotted", "trainable_parameters"]


def _get(section: Any, key: str, default: Any = None) -> Any:
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def resolve_dotted(name: Any, *, key: str) -> Any:
    """Import `a.b.C` and return `C`; ValueError naming `key` when it cannot be resolved."""
    if not isinstance(name, str) or "." not in name:
        msg = f"{key}={name!r} must be a dotted import path such as 'torch.optim.AdamW'"
        raise ValueError(msg)
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        msg = f"{key}={name!r} cannot be imported ({exc}); check the module path and class name"
        raise ValueError(msg) from exc


def _resolve_kwargs(kwargs: Mapping[str, Any] | None, *, key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dict(kwargs or {}).items():
        if isinstance(v, str) and v.startswith("torch."):
            v = resolve_dotted(v, key=f"{key}.{k}")
        out[k] = v
    return out


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters with requires_grad (frozen ones get no optimizer state)."""
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(model: torch.nn.Module, optimizer_cfg: Any) -> torch.optim.Optimizer:
    """Instantiate `optimizer_cfg.name(trainable params, **kwargs)`."""
    cls = resolve_dotted(_get(optimizer_cfg, "name"), key="optimizer.name")
    kwargs = _resolve_kwargs(_get(optimizer_cfg, "kwargs"), key="optimizer.kwargs")
    params = trainable_parameters(model)
    if not params:
        msg = (
            "the model has no trainable parameters (every requires_grad is False); nothing to "
            "optimize"
        )
        raise ValueError(msg)
    if cls is getattr(torch.optim, "Adafactor", None) and any(
        hasattr(p, "device_mesh") for p in params
    ):
        # Its step squares a norm in place across the sharded dim, which DTensor refuses: the
        # first step would fail deep inside torch instead.
        msg = (
            f"optimizer.name={_get(optimizer_cfg, 'name')!r} cannot step FSDP2/DTensor-sharded "
            "parameters (a process group shards them, even at world size 1); run it in a "
            "single process without torchrun, or pick another optimizer (torch.optim.AdamW)"
        )
        raise ValueError(msg)
    try:
        return cls(params, **kwargs)
    except TypeError as exc:
        msg = f"optimizer.kwargs={kwargs!r} do not fit {cls.__name__} ({exc}); fix the kwargs"
        raise ValueError(msg) from exc


def _one_scheduler(optimizer: torch.optim.Optimizer, entry: Any, *, key: str):
    cls = resolve_dotted(_get(entry, "name"), key=f"{key}.name")
    kwargs = _resolve_kwargs(_get(entry, "kwargs"), key=f"{key}.kwargs")
    try:
        return cls(optimizer, **kwargs)
    except TypeError as exc:
        msg = f"{key}.kwargs={kwargs!r} do not fit {cls.__name__} ({exc}); fix the kwargs"
        raise ValueError(msg) from exc


def build_scheduler(optimizer: torch.optim.Optimizer, scheduler_cfg: Any):
    """LR scheduler of `scheduler_cfg` (None -> constant LambdaLR(1))."""
    if scheduler_cfg is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda _: 1.0)
    if hasattr(scheduler_cfg, "entries"):  # policyworker.config.SchedulerConfig
        entries = [*scheduler_cfg.entries, {"milestones": list(scheduler_cfg.milestones)}]
        return build_scheduler(optimizer, entries)
    if isinstance(scheduler_cfg, Sequence) and not isinstance(scheduler_cfg, (str, bytes)):
        entries = [e for e in scheduler_cfg if _get(e, "milestones") is None]
        milestone_entries = [e for e in scheduler_cfg if _get(e, "milestones") is not None]
        if len(milestone_entries) != 1:
            msg = (
                f"scheduler is a list with {len(milestone_entries)} 'milestones' entries; "
                f"a list needs exactly one {{milestones: [...]}} entry besides the schedulers"
            )
            raise ValueError(msg)
        milestones = list(_get(milestone_entries[0], "milestones"))
        if len(milestones) != len(entries) - 1:
            msg = (
                f"scheduler.milestones={milestones} has {len(milestones)} entries for "
                f"{len(entries)} schedulers; give one milestone fewer than schedulers"
            )
            raise ValueError(msg)
        schedulers = [
            _one_scheduler(optimizer, e, key=f"scheduler[{i}]") for i, e in enumerate(entries)
        ]
        if len(schedulers) == 1:
            return schedulers[0]
        return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones=milestones)
    return _one_scheduler(optimizer, scheduler_cfg, key="scheduler")

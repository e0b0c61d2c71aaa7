"""Several named LoRA adapters on one frozen base, and the base without any adapter.

The model holds one set of `LinearLoRA` modules: the active adapter. Every other adapter waits
in an `AdapterBank` as a copy of its adapter weights (this rank's shards), its optimizer state
(the per-parameter dicts themselves, moved, not copied) and its LR scheduler state. Selecting
an adapter swaps both ways, so training adapter ``b`` after ``a`` runs exactly the steps a
worker holding only ``b`` would run: the base weights are shared, nothing else is. Memory per
extra adapter: its weights and its optimizer state, nothing of the base.

All adapters share `lora_cfg`'s settings (target modules, dim, alpha) and start from the same
values (the ones a single-adapter worker with that config and seed starts from).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from policyworker.shell.model.lora import lora_modules, lora_parameters

__all__ = [
    "AdapterBank",
    "adapter_names",
    "base_is_reference",
    "base_only",
    "base_reference",
    "build_bank",
    "check_name",
    "select",
]


@attrs.define
class _Parked:
    """One adapter out of the model: weights, optimizer state per parameter, scheduler state."""

    weights: list[torch.Tensor]
    optimizer_state: list[dict[str, Any] | None]
    scheduler_state: dict[str, Any] | None
    lrs: list[float]


@attrs.define
class AdapterBank:
    """The adapter names, which one the model holds, and every other one parked."""

    names: tuple[str, ...]
    active: str
    parked: dict[str, _Parked]


def build_bank(state: Any) -> AdapterBank | None:
    """The bank of `lora_cfg.adapters` (None without LoRA or with fewer than two names): every
    adapter but the first parked as the model's current adapter with a fresh optimizer state."""
    lora_cfg = state.cfg.dtensor_cfg.lora_cfg
    names = tuple(lora_cfg.adapters) if lora_cfg is not None else ()
    if len(names) < 2:
        return None
    first = _park(state, keep_optimizer_state=True)
    fresh = attrs.evolve(first, optimizer_state=[None] * len(first.optimizer_state))
    parked = {  # nothing shared between adapters: each gets its own copies
        n: attrs.evolve(
            fresh,
            weights=[w.clone() for w in fresh.weights],
            scheduler_state=copy.deepcopy(fresh.scheduler_state),
            lrs=list(fresh.lrs),
        )
        for n in names[1:]
    }
    return AdapterBank(names=names, active=names[0], parked=parked)


def adapter_names(state: Any) -> tuple[str, ...]:
    """The names `adapter=` accepts on this worker (empty: one unnamed adapter)."""
    lora_cfg = state.cfg.dtensor_cfg.lora_cfg
    return tuple(lora_cfg.adapters) if lora_cfg is not None else ()


def check_name(state: Any, name: str | None) -> None:
    """ValueError for an adapter name this worker does not have (before any work)."""
    if name is None:
        return
    names = adapter_names(state)
    if name not in names:
        msg = (
            f"adapter={name!r} is not an adapter of this worker; lora_cfg.adapters is "
            f"{list(names)}: pass one of them, or declare it under policy.dtensor_cfg.lora_cfg."
            "adapters"
        )
        raise ValueError(msg)


def select(state: Any, name: str | None) -> None:
    """Make `name` the model's adapter (None or the active one: nothing to do)."""
    check_name(state, name)
    bank: AdapterBank | None = state.adapters
    if name is None or bank is None or name == bank.active:
        return
    incoming = bank.parked.pop(name)
    outgoing = _park(state, keep_optimizer_state=False)
    bank.parked[bank.active] = outgoing
    _unpark(state, incoming, like=outgoing.optimizer_state)
    bank.active = name


def _live(state: Any) -> list[torch.nn.Parameter]:
    state.reshard()
    return lora_parameters(state.model)


def _park(state: Any, *, keep_optimizer_state: bool) -> _Parked:
    """The model's adapter as a `_Parked`; its optimizer state leaves the optimizer unless
    `keep_optimizer_state` (the bank's first copy, whose state stays live)."""
    params = _live(state)
    opt, sched = state.optimizer, state.scheduler
    with torch.no_grad():
        weights = [p.detach().clone() for p in params]
    if opt is None:
        states: list[dict[str, Any] | None] = [None] * len(params)
    elif keep_optimizer_state:
        states = [copy.copy(opt.state.get(p)) for p in params]
    else:
        states = [opt.state.pop(p, None) for p in params]
    return _Parked(
        weights=weights,
        optimizer_state=states,
        scheduler_state=copy.deepcopy(sched.state_dict()) if sched is not None else None,
        lrs=[g["lr"] for g in opt.param_groups] if opt is not None else [],
    )


def _unpark(state: Any, parked: _Parked, *, like: list[dict[str, Any] | None]) -> None:
    """Put `parked` into the model and the optimizer; its optimizer state tensors move to the
    devices of the state they replace (`like`): an offload (`move_optimizer_to_device`) moved
    only the state the optimizer held then."""
    params = _live(state)
    opt, sched = state.optimizer, state.scheduler
    with torch.no_grad():
        for p, w in zip(params, parked.weights, strict=True):
            p.copy_(w)
    if opt is not None:
        for p, s, here in zip(params, parked.optimizer_state, like, strict=True):
            if s is None:
                opt.state.pop(p, None)
            else:
                opt.state[p] = _on_devices_of(s, here)
        for g, lr in zip(opt.param_groups, parked.lrs, strict=True):
            g["lr"] = lr
    if sched is not None and parked.scheduler_state is not None:
        sched.load_state_dict(parked.scheduler_state)


def _on_devices_of(opt_state: dict[str, Any], like: dict[str, Any] | None) -> dict[str, Any]:
    """`opt_state` with each tensor on the device of `like`'s tensor of the same key."""
    if not like:
        return opt_state
    out = dict(opt_state)
    for key, value in opt_state.items():
        target = like.get(key)
        if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor):
            out[key] = value.to(target.device)
    return out


@contextlib.contextmanager
def base_only(state: Any) -> Iterator[None]:
    """Every adapter switched off: the model computes its frozen base (no weights copied)."""
    modules = list(lora_modules(state.model).values())
    for m in modules:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.adapter_enabled = True


def base_is_reference(state: Any) -> bool:
    """Whether the reference policy is the base model without adapters (`lora_cfg.reference`)."""
    lora_cfg = state.cfg.dtensor_cfg.lora_cfg
    return lora_cfg is not None and lora_cfg.reference == "base"


@contextlib.contextmanager
def base_reference(state: Any) -> Iterator[None]:
    """The reference policy as the base model: adapters off, filters off, temperature kept."""
    sampling = state.sampling
    try:
        state.sampling = sampling.unfiltered()
        with base_only(state), torch.no_grad():
            yield
    finally:
        state.sampling = sampling

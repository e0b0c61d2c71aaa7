"""A second weight set of a running vLLM model: refits load into it off the decode path.

``ShadowWeights(model, model_config, load_into)`` clones the module tree of vLLM's model once
(each module shallow-copied, its parameters and buffers cloned, its own containers copied, so
loading it never writes into what serves; everything else, such as the attention layers' KV
cache and their ``static_forward_context`` registration, stays the live model's and is never
duplicated). ``load(pairs)`` runs vLLM's layerwise reload on the clone, on the thread that
receives refits, while the engine keeps decoding on the live model; ``exchange()`` (between two
engine steps) swaps every parameter's and buffer's storage (``.data``) and the packed CPU
kernels (``cpu_linear``) between live and clone per module: the live modules stay the objects
vLLM holds, now serving the loaded version; the clone holds the previous one, overwritten by
the next load. The clone is never served until a load completes, so a load failing midway
needs no rollback: ``ready`` is False until the next complete load.

Memory: one extra weight set (the processed kernels included; the worker logs its size).

CPU only: on CUDA the kernels are captured in graphs (unless ``enforce_eager``) that hold the
live storage's addresses, so an exchange there would have to copy clone -> live instead (a copy
of one weight set per swap, still without the load and its processing);
``shadow_unavailable`` says so and the worker keeps the snapshot path there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from types import MethodType
from typing import Any, cast

import torch

__all__ = ["ShadowWeights", "shadow_unavailable"]

# vLLM's CPU linear processing packs each weight into the closure `cpu_linear`; it is the
# serving state beside the registered tensors (the snapshot path restores the same set).
KERNEL_ATTRS = ("cpu_linear",)
# the name of the function vLLM's layerwise reload wraps each weight loader in
RELOAD_WRAPPER = "online_process_loader"
_TREE = ("_parameters", "_buffers", "_modules")


def shadow_unavailable(model: torch.nn.Module, *, cpu_moe: bool, drafter: bool) -> str | None:
    """Why a shadow cannot serve ``model`` (None: it can)."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "cpu":
        return (
            f"the model is on {first.device.type}: captured graphs hold the live weights' "
            f"addresses, so a swap must copy into them"
        )
    if cpu_moe:
        return "CPU MoE experts keep packed weights in their kernel object, shared by a clone"
    if drafter:
        return "a speculative drafter is refit together with the model"
    return None


def _rebind(tensor: torch.Tensor, old: torch.nn.Module, new: torch.nn.Module) -> torch.Tensor:
    """A meta copy of ``tensor`` (vLLM's reload metadata) whose weight loaders bound to ``old``
    (or to vLLM's sanitized placeholder) are bound to ``new``.

    A reload of ``old`` registers these very metadata tensors and wraps their loaders in
    ``online_process_loader`` closures over ``old``'s reload state, which stay after it: the
    copy gets the loader under the wrappers, or the clone's loads would go to ``old``, which
    drops them as excess and leaves the clone on its previous weights."""
    from vllm.model_executor.model_loader.reload.sanitize import (  # pyright: ignore[reportMissingImports]
        layer_ref_sentinel,
    )

    def rebound(value: Any) -> Any:
        while callable(value) and getattr(value, "__name__", None) == RELOAD_WRAPPER:
            value = cast(Any, value).__wrapped__  # functools.wraps set it
        if isinstance(value, MethodType) and (
            value.__self__ is old or value.__self__ is layer_ref_sentinel
        ):
            return value.__func__.__get__(new)
        return value

    meta = torch.empty_strided(
        tuple(tensor.size()), tuple(tensor.stride()), dtype=tensor.dtype, device="meta"
    )
    meta.__class__ = tensor.__class__
    vars(meta).update({key: rebound(value) for key, value in tensor.__dict__.items()})
    return meta


def _clone_tensor(tensor: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    if id(tensor) not in memo:
        clone = tensor.data.clone()
        if isinstance(tensor, torch.nn.Parameter):  # keep vLLM's parameter class and loaders
            clone.__class__ = tensor.__class__
            vars(clone).update(vars(tensor))
        memo[id(tensor)] = clone
    return memo[id(tensor)]


def _clone_tree(module: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    if id(module) in memo:  # a module reached twice (tied layers) stays one module
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, list, set)) and key not in _TREE:
            clone.__dict__[key] = copy.copy(value)  # hooks, buffer sets: the reload edits them
    vars(clone).update(
        _parameters={
            n: None if p is None else _clone_tensor(p, memo) for n, p in module._parameters.items()
        },
        _buffers={
            n: None if b is None else _clone_tensor(b, memo) for n, b in module._buffers.items()
        },
        _modules={
            n: None if m is None else _clone_tree(m, memo) for n, m in module._modules.items()
        },
    )
    return clone


class ShadowWeights:
    """A clone of ``model`` that ``load_into(clone)`` (a ``load_weights(pairs)`` factory, vLLM's
    layerwise loader without its snapshot) fills; ``exchange()`` makes it serve."""

    def __init__(
        self,
        model: torch.nn.Module,
        load_into: Callable[[torch.nn.Module], Callable[[Iterable[Any]], None]],
    ) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (  # pyright: ignore[reportMissingImports]
            get_layerwise_info,
        )

        self.live = model
        with torch.no_grad():
            self.shadow = _clone_tree(model, {})
        self._pairs = list(zip(model.modules(), self.shadow.modules(), strict=True))
        for live, shadow in self._pairs:  # the clone reloads from its own copy of the metadata
            info, mine = get_layerwise_info(live), get_layerwise_info(shadow)
            params, buffers = info.restore_metadata
            mine.restore_metadata = (
                {n: _rebind(t, live, shadow) for n, t in params.items()},
                {n: _rebind(t, live, shadow) for n, t in buffers.items()},
            )
            mine.restore_device = info.restore_device
        self._load = load_into(self.shadow)
        self.ready = False  # the clone holds a complete version not yet served

    def _tensor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seen, found = set(), []
        for live, shadow in self._pairs:
            for table in ("_parameters", "_buffers"):
                mine, theirs = getattr(live, table), getattr(shadow, table)
                for name, tensor in mine.items():
                    if tensor is not None and id(tensor) not in seen:
                        seen.add(id(tensor))  # a tied tensor exchanged twice would not move
                        found.append((tensor, theirs[name]))
        return found

    def load(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one complete version into the clone (the live model keeps serving); a failure
        leaves ``ready`` False and the next complete load overwrites the whole clone."""
        self.ready = False
        self._load(pairs)
        self.ready = True

    def exchange(self) -> None:
        """Serve the loaded clone: swap storage and packed kernels with the live model."""
        assert self.ready, "exchange() without a complete load"
        with torch.no_grad():
            for live, shadow in self._tensor_pairs():
                live.data, shadow.data = shadow.data, live.data
        for live, shadow in self._pairs:
            for attr in KERNEL_ATTRS:
                if attr in live.__dict__ or attr in shadow.__dict__:
                    mine, theirs = live.__dict__.get(attr), shadow.__dict__.get(attr)
                    live.__dict__[attr], shadow.__dict__[attr] = theirs, mine
        self.ready = False

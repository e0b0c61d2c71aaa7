"""Adapter-only refits: the LoRA tensors alone, under PEFT's names, instead of merged weights.

Sender side: `adapter_stream(model)` is a `RefitStream` of every `LinearLoRA`'s ``lora_A`` /
``lora_B`` weight (fp32, full tensors: DTensors are gathered while iterating, on every rank)
named as PEFT saves them, ``base_model.model.<module>.lora_{A,B}.weight``; `adapter_refit_info`
is its ``{name: (shape, dtype)}``. Any transport that takes a `RefitStream` sends it (the ZMQ
sender's ``send``); a rank-16 adapter of a 7B model is ~1 % of the merged bf16 weights. A refit
sender keeps an `AdapterStreams`, so a steady-state refit reuses the names, specs and parameter
list of its last one (checked by object identity every refit, see `_AdapterWalk.matches`): its
host cost is then the transport's, not a walk of every module by name.

Receiver side: `peft_load_weights(peft_model, refit_info)` is a ``load_weights`` callable for
`HFWeightReceiver`: it writes those tensors into a ``peft.PeftModel``'s adapter (named
``adapter_name``). Every name is resolved when it is built (a module the model lacks is a
`ValueError` naming it), so the receiver's manifest checks and atomic staging apply as for a
full refit, and each complete refit is one receiver version.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import attrs
import torch
from torch import nn

from policyworker.functional.buckets import TensorSpec
from policyworker.functional.lora import from_peft_key, to_peft_key
from policyworker.shell.model.lora import lora_modules
from policyworker.shell.refit.live_state import ModuleTree
from policyworker.shell.refit.weight_stream import RefitSource, RefitStream, plain_tensors

__all__ = ["AdapterStreams", "adapter_refit_info", "adapter_stream", "peft_load_weights"]


_PARAMETERS = attrgetter("_parameters")
_WEIGHT = repeat("weight")  # an endless "weight" for map(dict.get, ...)


@attrs.frozen(eq=False)
class _AdapterWalk:
    """One model's adapter stream, worked out once: the PEFT names, the ``lora_A``/``lora_B``
    modules holding the weights, the weights with their shapes, and the wire specs."""

    model: nn.Module
    dtype: torch.dtype
    tree: ModuleTree | None  # the model's tree when compiled; None: never reused
    holders: list[nn.Module]
    params: list[torch.Tensor]
    shapes: list[torch.Size]
    names: tuple[str, ...]
    specs: tuple[TensorSpec, ...]
    plain: list[torch.Tensor] | None  # ``params`` when none needs a gather (a class is fixed)

    def matches(self, model: nn.Module, dtype: torch.dtype) -> bool:
        """Still this model's adapter stream in ``dtype``: no module of its tree added, removed
        or replaced (so the same LoRA modules under the same names), and each adapter weight
        still the same parameter object (``.data =`` is read live) of the same shape."""
        return (
            model is self.model
            and dtype == self.dtype
            and self.tree is not None
            and self.tree.same_as(ModuleTree.of(model))
            and all(map(is_, map(dict.get, map(_PARAMETERS, self.holders), _WEIGHT), self.params))
            and [p.shape for p in self.params] == self.shapes
        )


def _compile(model: nn.Module, dtype: torch.dtype) -> _AdapterWalk:
    tree = ModuleTree.of(model)
    modules = lora_modules(model)
    if not modules:
        msg = (
            "adapter_only=True needs a LoRA model (policy.dtensor_cfg.lora_cfg set); this model "
            "has no LinearLoRA modules: refit the full weights instead"
        )
        raise ValueError(msg)
    names, holders = [], []
    for name, module in modules.items():
        for ab in ("A", "B"):
            names.append(to_peft_key(f"{name}.lora_{ab}.weight"))
            holders.append(getattr(module, f"lora_{ab}"))
    params = [h.weight for h in holders]
    # the reuse check reads the registered parameter; a holder whose weight is something else
    # (a property, say) gets a fresh walk every refit
    registered = all(h._parameters.get("weight") is p for h, p in zip(holders, params, strict=True))
    specs = tuple(TensorSpec(n, tuple(p.shape), dtype) for n, p in zip(names, params, strict=True))
    return _AdapterWalk(
        model,
        dtype,
        tree if registered else None,
        holders,
        params,
        [p.shape for p in params],
        tuple(names),
        specs,
        plain_tensors(params),
    )


class AdapterStreams:
    """The adapter walk an owner (a refit sender) compiled at its last refit, reused while
    ``_AdapterWalk.matches`` holds and compiled again otherwise, so a steady-state adapter
    refit sends the same specs object (a transport's manifest frame, bucket plan and one-pass
    destination views are cached per specs object) without walking the model by name."""

    def __init__(self) -> None:
        self._walk: _AdapterWalk | None = None

    def walk(self, model: nn.Module, dtype: torch.dtype) -> _AdapterWalk:
        walk = self._walk
        if walk is None or not walk.matches(model, dtype):
            walk = self._walk = _compile(model, dtype)
        return walk


def adapter_refit_info(
    model: nn.Module, *, dtype: torch.dtype
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{peft_name: (shape, dtype)}`` of `adapter_stream`, in send order (global shapes)."""
    return {s.name: (torch.Size(s.shape), dtype) for s in _compile(model, dtype).specs}


def adapter_stream(
    model: nn.Module, *, dtype: torch.dtype, cache: AdapterStreams | None = None
) -> RefitStream:
    """The adapter tensors of `model` as one refit's stream (specs now, sources lazily), sent
    in `dtype`. The worker passes its full refit's dtype (the compute precision): an engine
    serves adapters in its own dtype, so fp32 would only double the bytes of a bf16 run.
    ``cache``: the caller's `AdapterStreams`, kept across its refits (None: walk afresh)."""
    walk = _compile(model, dtype) if cache is None else cache.walk(model, dtype)

    def sources() -> Generator[RefitSource, None, None]:
        for name, param in zip(walk.names, walk.params, strict=True):
            full = param.detach()
            gather = getattr(full, "full_tensor", None)  # DTensor: a collective on every rank
            yield RefitSource(name, gather() if gather is not None else full, dtype)

    return RefitStream(walk.specs, ("adapter", walk), sources(), walk.plain)


def peft_load_weights(
    peft_model: nn.Module, refit_info: Mapping[str, Any], *, adapter_name: str = "default"
) -> Any:
    """A ``load_weights`` callable writing adapter refits into `peft_model`'s `adapter_name`.

    Raises:
        ValueError: a name of `refit_info` is not a LoRA weight of that adapter in the model,
            or its shape differs (every module must be reachable: nothing is skipped).
    """
    live = dict(peft_model.named_parameters())
    dests: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, (shape, _) in refit_info.items():
        module, _, leaf = from_peft_key(name).rpartition(".lora_")
        key = f"base_model.model.{module}.lora_{leaf.removesuffix('.weight')}.{adapter_name}.weight"
        param = live.get(key)
        if param is None:
            problems.append(f"{name!r}: no parameter {key!r}")
        elif tuple(param.shape) != tuple(shape):
            problems.append(f"{name!r}: model {list(param.shape)}, refit_info {list(shape)}")
        else:
            dests[name] = param
    if problems:
        msg = (
            f"the PEFT model cannot receive {len(problems)} adapter tensor(s) of adapter "
            f"{adapter_name!r}: " + "; ".join(problems[:20]) + ". Wrap the engine's model with "
            "the trainer's adapter (PeftModel.from_pretrained on its save_weights folder, or the "
            "same target modules and rank)"
        )
        raise ValueError(msg)

    def load_weights(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in pairs:
                dests[name].copy_(tensor)

    return load_weights

"""Adapter-only refits: the LoRA tensors alone, under PEFT's names, instead of merged weights.

Sender side: `adapter_stream(model)` is a `RefitStream` of every `LinearLoRA`'s ``lora_A`` /
``lora_B`` weight (fp32, full tensors: DTensors are gathered while iterating, on every rank)
named as PEFT saves them, ``base_model.model.<module>.lora_{A,B}.weight``; `adapter_refit_info`
is its ``{name: (shape, dtype)}``. Any transport that takes a `RefitStream` sends it (the ZMQ
sender's ``send``); a rank-16 adapter of a 7B model is ~1 % of the merged bf16 weights.

Receiver side: `peft_load_weights(peft_model, refit_info)` is a ``load_weights`` callable for
`HFWeightReceiver`: it writes those tensors into a ``peft.PeftModel``'s adapter (named
``adapter_name``). Every name is resolved when it is built (a module the model lacks is a
`ValueError` naming it), so the receiver's manifest checks and atomic staging apply as for a
full refit, and each complete refit is one receiver version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from policyworker.functional.buckets import TensorSpec
from policyworker.functional.lora import from_peft_key, to_peft_key
from policyworker.shell.model.lora import lora_modules
from policyworker.shell.refit.weight_stream import RefitSource, RefitStream

__all__ = ["adapter_refit_info", "adapter_stream", "peft_load_weights"]


def _adapter_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    modules = lora_modules(model)
    if not modules:
        msg = (
            "adapter_only=True needs a LoRA model (policy.dtensor_cfg.lora_cfg set); this model "
            "has no LinearLoRA modules: refit the full weights instead"
        )
        raise ValueError(msg)
    return [
        (to_peft_key(f"{name}.lora_{ab}.weight"), getattr(m, f"lora_{ab}").weight)
        for name, m in modules.items()
        for ab in ("A", "B")
    ]


def adapter_refit_info(
    model: nn.Module, *, dtype: torch.dtype
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{peft_name: (shape, dtype)}`` of `adapter_stream`, in send order (global shapes)."""
    return {name: (torch.Size(p.shape), dtype) for name, p in _adapter_params(model)}


def adapter_stream(model: nn.Module, *, dtype: torch.dtype) -> RefitStream:
    """The adapter tensors of `model` as one refit's stream (specs now, sources lazily), sent
    in `dtype`. The worker passes its full refit's dtype (the compute precision): an engine
    serves adapters in its own dtype, so fp32 would only double the bytes of a bf16 run."""
    params = _adapter_params(model)
    specs = tuple(TensorSpec(n, tuple(p.shape), dtype) for n, p in params)

    def sources():
        for name, param in params:
            full = param.detach()
            gather = getattr(full, "full_tensor", None)  # DTensor: a collective on every rank
            yield RefitSource(name, gather() if gather is not None else full, dtype)

    return RefitStream(specs, ("adapter", specs), sources())


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

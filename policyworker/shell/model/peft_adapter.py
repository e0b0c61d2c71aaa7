"""PEFT LoRA adapter folders: export (`save_peft_adapter`) and import (`load_peft_adapter`).

Layout written and read: `adapter_config.json` (peft's `LoraConfig` keys) and
`adapter_model.safetensors` with keys `base_model.model.<module>.lora_{A,B}.weight`. The
modules themselves are `shell.lora.LinearLoRA`.
"""

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from policyworker.functional.lora import from_peft_key, lora_scale, to_peft_key
from policyworker.shell.model.lora import (
    LinearLoRA,
    LoRASettings,
    _inject,
    _linear_names,
    lora_modules,
    lora_settings,
    lora_state_dict,
)

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "load_peft_adapter",
    "peft_adapter_config",
    "save_peft_adapter",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def _uniform(modules: Mapping[str, LinearLoRA], attr: str) -> Any:
    values = {getattr(m, attr) for m in modules.values()}
    if len(values) != 1:
        msg = (
            f"LoRA modules disagree on {attr} ({sorted(values)}); one adapter folder needs one "
            "value"
        )
        raise ValueError(msg)
    return values.pop()


def peft_adapter_config(
    model: nn.Module, *, lora_cfg: Any = None, base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """The ``adapter_config.json`` of `model`'s adapter (peft's ``LoraConfig`` keys).

    ``target_modules`` lists the exact module names, so PEFT adapts exactly these layers; the
    adapter-only refit into vLLM sends this dict instead of a folder.
    """
    modules = lora_modules(model)
    if not modules:
        msg = "the model has no LinearLoRA modules; call apply_lora first"
        raise ValueError(msg)
    dropout = lora_settings(lora_cfg).dropout if lora_cfg is not None else 0.0
    return {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model_name_or_path,
        "r": _uniform(modules, "dim"), "lora_alpha": _uniform(modules, "alpha"),
        "use_rslora": _uniform(modules, "use_rslora"), "lora_dropout": dropout,
        "target_modules": sorted(modules), "exclude_modules": None, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False, "lora_bias": False,
    }  # fmt: skip


def save_peft_adapter(
    model: nn.Module,
    folder: str | pathlib.Path,
    *,
    lora_cfg: Any = None,
    base_model_name_or_path: str | None = None,
    write: bool = True,
) -> pathlib.Path:
    """Write a PEFT LoRA adapter folder.

    The folder loads with ``peft.PeftModel.from_pretrained(base, folder)``.

    ``target_modules`` is written as the exact module names, so PEFT adapts exactly these layers.
    With DTensor adapters every rank must call this (gathers); pass ``write=False`` on ranks > 0.
    """
    if not lora_modules(model):
        msg = "save_peft_adapter: the model has no LinearLoRA modules; call apply_lora first"
        raise ValueError(msg)
    config = peft_adapter_config(
        model, lora_cfg=lora_cfg, base_model_name_or_path=base_model_name_or_path
    )
    tensors = {to_peft_key(k): v for k, v in lora_state_dict(model).items()}
    path = pathlib.Path(folder)
    if write:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


_UNSUPPORTED_PEFT = {  # key -> value that we support
    "use_dora": False, "bias": "none", "fan_in_fan_out": False, "lora_bias": False,
    "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
}  # fmt: skip


def _read_adapter(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_file, weights_file = path / ADAPTER_CONFIG_FILE, path / ADAPTER_WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            msg = (
                f"PEFT adapter folder {str(path)!r} has no {file.name}; expected peft's "
                "save_pretrained layout"
            )
            raise ValueError(msg)
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA":
        msg = (
            f"{config_file}: peft_type {config.get('peft_type')!r} is not 'LORA'; only LoRA "
            "adapters load"
        )
        raise ValueError(msg)
    bad = {
        k: config[k]
        for k, ok in _UNSUPPORTED_PEFT.items()
        if config.get(k, ok) not in (ok, None, {}, False)
    }
    if bad:
        msg = (
            f"{config_file}: unsupported PEFT LoRA options {bad}; re-train without them "
            f"({_UNSUPPORTED_PEFT})"
        )
        raise ValueError(msg)
    weights: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(weights_file)).items():
        name = from_peft_key(key)
        if not name.endswith((".lora_A.weight", ".lora_B.weight")):
            msg = (
                f"{weights_file}: key {key!r} is not a LoRA A/B weight; only plain LoRA adapters "
                "load"
            )
            raise ValueError(msg)
        weights[name] = tensor
    return config, weights


def _check_against_model(
    modules: Mapping[str, LinearLoRA], weights: Mapping[str, torch.Tensor], where: str
) -> None:
    expected = {
        f"{n}.lora_{ab}.weight": ((m.dim, m.in_features) if ab == "A" else (m.out_features, m.dim))
        for n, m in modules.items()
        for ab in ("A", "B")
    }
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = sorted(
        f"{k}: file {tuple(weights[k].shape)} vs model {expected[k]}"
        for k in set(expected) & set(weights)
        if tuple(weights[k].shape) != expected[k]
    )
    if missing or unexpected or wrong:
        msg = (
            f"adapter {where!r} does not fit the model's LoRA modules: missing keys {missing}, "
            f"unexpected keys {unexpected}, shape mismatches {wrong}; load an adapter trained for "
            "this model and lora_cfg (same target modules and dim)"
        )
        raise ValueError(msg)


def load_peft_adapter(model: nn.Module, folder: str | pathlib.Path) -> list[str]:
    """Load a PEFT LoRA adapter folder (ours or peft's ``save_pretrained``) into ``model``.

    A model without LoRA modules gets `LinearLoRA` at exactly the adapter's module names (rank
    from the tensors, alpha/rslora/dropout from the config); a model with LoRA modules must have
    exactly the adapter's modules and shapes. Values are copied into the existing Parameters (so
    an optimizer holding them stays valid) and every module's scale is set from the config.

    Returns:
        The adapted module names, sorted.
    """
    path = pathlib.Path(folder)
    config, weights = _read_adapter(path)
    names = sorted({k.rsplit(".", 2)[0] for k in weights})
    modules = lora_modules(model)
    if not modules:
        linears = set(_linear_names(model))
        absent = [n for n in names if n not in linears]
        if absent:
            msg = (
                f"adapter {str(path)!r} adapts modules that are not nn.Linear modules of the "
                f"model: {absent}"
            )
            raise ValueError(msg)
        s = LoRASettings(
            alpha=float(config.get("lora_alpha", 8)),
            use_rslora=bool(config.get("use_rslora", False)),
            dropout=float(config.get("lora_dropout") or 0.0),
        )
        dims = {
            n: int(weights[f"{n}.lora_A.weight"].shape[0])
            for n in names
            if f"{n}.lora_A.weight" in weights
        }
        _inject(model, [n for n in names if n in dims], dims=dims, s=s, autocast_dtype=None)
        modules = lora_modules(model)
    _check_against_model(modules, weights, str(path))
    alpha, use_rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    with torch.no_grad():
        for name, m in modules.items():
            for ab, param in (("A", m.lora_A.weight), ("B", m.lora_B.weight)):
                _copy_full_into(param, weights[f"{name}.lora_{ab}.weight"])
            m.alpha, m.scale = alpha, lora_scale(alpha, m.dim, use_rslora)
            m.use_rslora = use_rslora
    return sorted(modules)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):  # every rank holds the full tensor; keep only the local shard
        full = distribute_tensor(
            full.to(param.device, param.dtype), param.device_mesh, param.placements
        )
    param.copy_(full)

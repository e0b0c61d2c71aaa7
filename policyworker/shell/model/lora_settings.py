"""The `lora_cfg` settings LoRA reads: `LoRASettings`, read from a `LoRAConfig` or a NeMo-RL
mapping and checked (each bad value named with its rule), and the adapter matmul dtype that
`compute_dtype` names on a device. `shell/model/lora.py` builds `LinearLoRA` modules from them.
"""

from collections.abc import Mapping
from typing import Any, Literal

import torch
from attrs import frozen

from policyworker.functional.lora import lora_scale, validate_target_entries

__all__ = ["LoRASettings", "lora_settings", "resolve_compute_dtype"]

_SETTING_KEYS = (
    "enabled", "target_modules", "exclude_modules", "match_all_linear", "dim", "alpha", "dropout",
    "dropout_position", "lora_A_init", "use_rslora", "use_triton", "compute_dtype",
    "adapters", "reference",
)  # fmt: skip
# keys of the worker, not of the modules: no Triton kernel here; adapter names and the reference
# policy are read by shell/worker/adapters.py
_NOT_READ = ("use_triton", "adapters", "reference")
_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@frozen(kw_only=True)
class LoRASettings:
    """The `lora_cfg` values this module reads.

    Defaults equal `policyworker.config.LoRAConfig`'s.
    """

    enabled: bool = True
    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    match_all_linear: bool = False
    dim: int = 8
    alpha: float = 32.0
    dropout: float = 0.0
    dropout_position: Literal["pre", "post"] = "post"
    lora_A_init: Literal["xavier", "uniform"] = "xavier"  # noqa: N815 (NeMo-RL's key)
    use_rslora: bool = False
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


def resolve_compute_dtype(
    setting: str, *, device: torch.device, base_dtype: torch.dtype
) -> torch.dtype:
    """The adapter matmul dtype that `lora_cfg.compute_dtype` names on `device`.

    ``"auto"`` is bfloat16 on CUDA when the base layers compute in bfloat16 (``base_dtype``: the
    base weights' dtype, or the autocast dtype over fp32 master weights), float32 otherwise.

    Raises:
        ValueError: ``setting`` is not "auto" or a dtype name.
    """
    if setting == "auto":
        cuda_bf16 = device.type == "cuda" and base_dtype == torch.bfloat16
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if setting not in _COMPUTE_DTYPES:
        msg = (
            f"lora_cfg.compute_dtype {setting!r} must be 'auto' or one of "
            f"{list(_COMPUTE_DTYPES)}; use 'auto' unless you need a fixed dtype"
        )
        raise ValueError(msg)
    return _COMPUTE_DTYPES[setting]


def lora_settings(lora_cfg: Any) -> LoRASettings:
    """Read a `LoRAConfig` (attrs) or a plain mapping with the NeMo-RL `lora_cfg` keys.

    Raises:
        ValueError: unknown mapping keys, or a value outside its rule (named with the fix).
    """
    if isinstance(lora_cfg, Mapping):
        unknown = sorted(set(lora_cfg) - set(_SETTING_KEYS))
        if unknown:
            msg = f"unknown lora_cfg key(s) {unknown}; allowed keys are {list(_SETTING_KEYS)}"
            raise ValueError(msg)
        values = {k: lora_cfg[k] for k in _SETTING_KEYS if k in lora_cfg and k not in _NOT_READ}
    else:
        values = {
            k: getattr(lora_cfg, k)
            for k in _SETTING_KEYS
            if hasattr(lora_cfg, k) and k not in _NOT_READ
        }
    for key in ("target_modules", "exclude_modules"):
        entries = values.get(key) or ()
        if isinstance(entries, str):
            entries = (entries,)
        values[key] = tuple(entries)
        validate_target_entries(values[key], what=f"lora_cfg.{key}")
    settings = LoRASettings(**values)
    lora_scale(settings.alpha, settings.dim)  # validates dim
    if settings.dropout_position not in ("pre", "post"):
        msg = f"lora_cfg.dropout_position {settings.dropout_position!r} must be 'pre' or 'post'"
        raise ValueError(msg)
    if settings.lora_A_init not in ("xavier", "uniform"):
        msg = f"lora_cfg.lora_A_init {settings.lora_A_init!r} must be 'xavier' or 'uniform'"
        raise ValueError(msg)
    if not 0.0 <= settings.dropout < 1.0:
        msg = f"lora_cfg.dropout {settings.dropout!r} must be in [0, 1)"
        raise ValueError(msg)
    cpu = torch.device("cpu")
    resolve_compute_dtype(settings.compute_dtype, device=cpu, base_dtype=torch.float32)
    return settings

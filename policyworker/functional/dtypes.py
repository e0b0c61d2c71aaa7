"""Precision names and the refit dtype rule (the dtype each tensor is sent in by a refit).

All functions are pure: they look at names and dtypes only, never at devices or tensor values.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

__all__ = [
    "PRECISION_NAMES",
    "decode_refit_info",
    "encode_refit_info",
    "name_matches_pattern",
    "precision_dtype",
    "refit_tensor_dtype",
]

# Canonical names first; aliases map onto them. "torch.<name>" is accepted for every entry.
_PRECISIONS: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "float": torch.float32,
    "half": torch.float16,
}
PRECISION_NAMES: tuple[str, ...] = tuple(_PRECISIONS)

# DeepSeek-V3 / GLM-4-MoE routers keep this fp32 buffer even in a bf16 model (inference engines
# load it as fp32, so the refit must send fp32).
_ALWAYS_FP32_SUFFIX = "e_score_correction_bias"


def precision_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a precision name ("bfloat16", "bf16", "torch.bfloat16", ...).

    Raises:
        ValueError: the name is not one of float32 / bfloat16 / float16 or their aliases.
    """
    if isinstance(name, torch.dtype):
        if name in _PRECISIONS.values():
            return name
        key = str(name)
    else:
        key = str(name).strip().lower().removeprefix("torch.")
        if key in _PRECISIONS:
            return _PRECISIONS[key]
    msg = (
        f"precision {name!r} is not supported; choose one of {', '.join(PRECISION_NAMES)} "
        "(a 'torch.' prefix is also accepted)"
    )
    raise ValueError(msg)


def name_matches_pattern(fqn: str, pattern: str) -> bool:
    """True when ``pattern``'s dotted components appear contiguously among ``fqn``'s components.

    That covers ``fqn == pattern``, ``fqn.endswith("." + pattern)`` and a module name in the
    middle: "gate.weight" and "gate" match "model.layers.3.mlp.gate.weight", but neither matches
    "model.layers.3.mlp.gate_proj.weight".
    """
    parts, wanted = fqn.split("."), pattern.split(".")
    width = len(wanted)
    return any(parts[i : i + width] == wanted for i in range(len(parts) - width + 1))


def refit_tensor_dtype(
    fqn: str,
    tensor: torch.Tensor,
    default_dtype: torch.dtype,
    *,
    keep_fp32: Iterable[str] = (),
) -> torch.dtype:
    """The dtype a tensor is sent in during a refit.

    Rules, in order: a non-floating tensor (int, bool) keeps its dtype; an fp32 tensor whose name
    ends in ``e_score_correction_bias`` or matches a ``keep_fp32`` pattern (see
    ``name_matches_pattern``; the worker passes the model's ``_keep_in_fp32_modules`` and
    ``_keep_in_fp32_modules_strict``) stays fp32; every other floating tensor gets
    ``default_dtype``.

    Raises:
        ValueError: ``default_dtype`` is not a floating dtype.
    """
    if not default_dtype.is_floating_point:
        msg = (
            f"default_dtype {default_dtype} for refit of {fqn!r} must be a floating dtype "
            "(e.g. torch.bfloat16); integer and bool tensors keep their own dtype automatically"
        )
        raise ValueError(msg)
    patterns = (keep_fp32,) if isinstance(keep_fp32, str) else tuple(keep_fp32)
    dtype = tensor.dtype
    if not dtype.is_floating_point:
        return dtype
    if dtype == torch.float32 and (
        fqn.endswith(_ALWAYS_FP32_SUFFIX) or any(name_matches_pattern(fqn, p) for p in patterns)
    ):
        return torch.float32
    return default_dtype


def encode_refit_info(
    info: Mapping[str, tuple[Sequence[int], torch.dtype]],
) -> dict[str, list[Any]]:
    """``prepare_refit_info()``'s ``{name: (torch.Size, torch.dtype)}`` as JSON-able lists.

    ``{name: [[d0, d1, ...], "bfloat16"]}``: plain ints and dtype names, so it travels to the
    inference process as JSON (or through any RPC) without pickling torch objects.
    ``decode_refit_info`` inverts it.
    """
    return {
        name: [[int(d) for d in shape], str(dtype).removeprefix("torch.")]
        for name, (shape, dtype) in info.items()
    }


def decode_refit_info(encoded: Mapping[str, Any]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The inverse of ``encode_refit_info``: ``{name: (torch.Size, torch.dtype)}``.

    Raises:
        ValueError: an entry is not ``[shape, dtype name]`` or names no torch dtype.
    """
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for name, entry in encoded.items():
        pair = cast("Sequence[Any]", entry) if isinstance(entry, list | tuple) else ()
        if len(pair) != 2:
            msg = (
                f"refit_info[{name!r}]={entry!r} must be [shape, dtype name] as "
                f"encode_refit_info writes it; pass encode_refit_info(prepare_refit_info())"
            )
            raise ValueError(msg)
        shape, dtype_text = pair
        dtype = getattr(torch, str(dtype_text).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            msg = (
                f"refit_info[{name!r}] names dtype {dtype_text!r}, which is not a torch dtype; "
                f"use a name such as 'bfloat16' or 'float32'"
            )
            raise ValueError(msg)
        out[name] = (torch.Size(int(d) for d in shape), dtype)
    return out

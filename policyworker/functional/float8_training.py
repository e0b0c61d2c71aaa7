"""FP8 training decisions: which linear layers run their matmuls in float8, and whether the
device, the library and the layout support it at all. All functions are pure.

Float8 GEMMs (`torch._scaled_mm`) need compute capability >= 8.9 (Ada, Hopper and later) and
both dims of the weight divisible by 16. Only the decoder layers' linears are converted: the
output head and the embeddings keep their precision (the head's logits feed the loss directly,
and fp8 rounding there costs accuracy out of proportion to its share of the FLOPs), and so do
MoE routers (a rounding flip changes which experts run) and the modules the model keeps in fp32.
"""

import re

from attrs import frozen

from policyworker.functional.dtypes import name_matches_pattern

__all__ = [
    "DIM_MULTIPLE",
    "MIN_CAPABILITY",
    "MIN_TORCHAO",
    "ROUTER_NAMES",
    "Float8Plan",
    "LinearSpec",
    "float8_plan",
    "float8_unsupported_reason",
    "version_tuple",
]

MIN_CAPABILITY: tuple[int, int] = (8, 9)
DIM_MULTIPLE = 16
# The torchao release whose float8 training API (`convert_to_float8_training`, its recipes and
# `hp_tensor_to_float8_dynamic`) this worker was written against.
MIN_TORCHAO: tuple[int, int] = (0, 18)
# The leaf names of MoE router linears (Qwen-MoE / Mixtral `gate`, others `router`).
ROUTER_NAMES: tuple[str, ...] = ("gate", "router")


@frozen(kw_only=True)
class LinearSpec:
    """One linear module of the model: dotted name, weight shape, and whether a LoRA adapter
    wraps it (its base weight is frozen)."""

    name: str
    in_features: int
    out_features: int
    lora: bool = False


@frozen(kw_only=True)
class Float8Plan:
    """The linears to convert: plain ones (`converted`), LoRA ones whose frozen base GEMM runs
    in float8 (`lora`), and every other linear with the reason it stays as it is."""

    converted: tuple[str, ...] = ()
    lora: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()


def _in_layer(name: str, layer_prefixes: tuple[str, ...]) -> bool:
    return any(name.startswith(prefix + ".") for prefix in layer_prefixes)


def float8_plan(
    linears: tuple[LinearSpec, ...],
    *,
    layer_prefixes: tuple[str, ...],
    keep_fp32: tuple[str, ...] = (),
) -> Float8Plan:
    """Split `linears` into those that run in float8 and those that stay.

    Args:
        layer_prefixes: the dotted names of the decoder layers (e.g. ``model.layers.0``); a
            linear qualifies only inside one of them.
        keep_fp32: module-name patterns the model keeps in fp32 (its
            ``_keep_in_fp32_modules``), matched as `name_matches_pattern` does.
    """
    converted: list[str] = []
    lora: list[str] = []
    skipped: list[tuple[str, str]] = []
    for spec in linears:
        if not _in_layer(spec.name, layer_prefixes):
            skipped.append((spec.name, "outside the decoder layers"))
        elif spec.name.rpartition(".")[2] in ROUTER_NAMES:
            skipped.append((spec.name, "a MoE router (routing stays in high precision)"))
        elif any(name_matches_pattern(spec.name, p) for p in keep_fp32):
            skipped.append((spec.name, "kept in fp32 by the model (_keep_in_fp32_modules)"))
        elif spec.in_features % DIM_MULTIPLE or spec.out_features % DIM_MULTIPLE:
            skipped.append(
                (
                    spec.name,
                    f"[{spec.out_features}, {spec.in_features}] is not divisible by "
                    f"{DIM_MULTIPLE} in both dims (a float8 GEMM needs it)",
                )
            )
        else:
            (lora if spec.lora else converted).append(spec.name)
    return Float8Plan(converted=tuple(converted), lora=tuple(lora), skipped=tuple(skipped))


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "0.18.0+cu126" -> (0, 18, 0)."""
    release = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in release.group(0).split(".")) if release else ()


def float8_unsupported_reason(
    *,
    device_type: str,
    capability: tuple[int, int] | None,
    torchao_version: str | None,
    has_scaled_mm: bool,
    tp_size: int,
) -> str | None:
    """Why float8 training cannot run here (the first reason found), or None when it can.

    Args:
        capability: the CUDA device's compute capability (None off CUDA).
        torchao_version: the installed torchao's version (None: not installed).
        has_scaled_mm: torch has `torch._scaled_mm`, the float8 GEMM.
    """
    if device_type != "cuda":
        return f"float8 matmuls need a CUDA device (the worker's device is {device_type})"
    if capability is not None and capability < MIN_CAPABILITY:
        need = ".".join(map(str, MIN_CAPABILITY))
        return (
            f"float8 matmuls need compute capability >= {need} (Ada, Hopper or later); this "
            f"GPU is {capability[0]}.{capability[1]}"
        )
    if not has_scaled_mm:
        return "this torch build has no torch._scaled_mm (the float8 GEMM)"
    if torchao_version is None:
        return "torchao is not installed; install the extra: pip install 'policyworker[fp8]'"
    if version_tuple(torchao_version)[:2] < MIN_TORCHAO:
        need = ".".join(map(str, MIN_TORCHAO))
        return f"torchao {torchao_version} is older than {need}; pip install 'torchao>={need}'"
    if tp_size > 1:
        return (
            f"tensor_parallel_size={tp_size}: float8 linears under tensor parallelism need "
            "torchao's float8 TP plans, which this worker does not apply"
        )
    return None

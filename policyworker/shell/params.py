"""The refit parameter stream: HF-named, dtype-correct tensors of a (possibly sharded) model.

One code path feeds every transport and the refit metadata (API.md §5, §7):

``iter_refit_sources`` walks ``model.state_dict()`` in order (parameters and persistent
buffers), gathers DTensors, merges LoRA into its base weight (after checking every LoRA module is
reachable), strips wrapper prefixes, drops a tied ``lm_head.weight``, splits transformers-5 fused
experts into per-expert checkpoint tensors, and picks each tensor's refit dtype — yielding the
*uncast* source with that dtype, so a transport can cast straight into its staging buffer. Then
the draft model's tensors follow as ``draft.<name>``.

``params_generator`` casts and makes each tensor contiguous; ``refit_info`` runs the same walk over
meta tensors (no gather, no copy) and records ``(shape, dtype)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import torch
from torch import nn

from policyworker.functional.buckets import TensorSpec
from policyworker.functional.dtypes import refit_tensor_dtype
from policyworker.functional.lora import assert_lora_modules_reachable, merge_lora_weight
from policyworker.functional.names import canonical_name, is_lora_param, to_hf_tensors

__all__ = [
    "DRAFT_PREFIX",
    "RefitSource",
    "iter_refit_sources",
    "keep_fp32_patterns",
    "params_generator",
    "refit_info",
    "refit_specs",
]

DRAFT_PREFIX = "draft."


@attrs.frozen
class RefitSource:
    """One tensor of the refit stream before its cast: the HF name, the source, the wire dtype."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, tuple(self.tensor.shape), self.dtype)


def keep_fp32_patterns(model: nn.Module) -> tuple[str, ...]:
    """The model's ``_keep_in_fp32_modules`` + ``_keep_in_fp32_modules_strict`` (API.md §7)."""
    patterns: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        patterns.extend(getattr(model, attr, None) or ())
    return tuple(patterns)


def _tie_word_embeddings(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    if config is None:
        return False
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def _lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """LoRA-wrapped linears, duck-typed (``lora_A``, ``lora_B``, ``scale``), by raw module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if all(hasattr(module, attr) for attr in ("lora_A", "lora_B", "scale"))
    }


def _materialize(tensor: torch.Tensor, *, meta: bool) -> torch.Tensor:
    """The full (unsharded) tensor, or a meta stand-in of its global shape and dtype."""
    tensor = tensor.detach()
    if meta:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    full_tensor = getattr(tensor, "full_tensor", None)  # DTensor: a collective on every rank
    return full_tensor() if full_tensor is not None else tensor


def _iter_one_model(
    model: nn.Module, target_dtype: torch.dtype, *, keep_fp32: Sequence[str], prefix: str, meta: bool
) -> Iterator[RefitSource]:
    state = model.state_dict()
    lora = _lora_modules(model)
    if lora:
        assert_lora_modules_reachable(lora, state.keys())
    drop_lm_head = _tie_word_embeddings(model)
    for key, value in state.items():
        if is_lora_param(key):
            continue
        name = canonical_name(key)
        if drop_lm_head and name == "lm_head.weight":
            continue
        full = _materialize(value, meta=meta)
        module = lora.get(key.removesuffix(".weight")) if key.endswith(".weight") else None
        if module is not None and not meta:  # merged weight has W's shape and dtype by contract
            lora_a = _materialize(module.lora_A.weight, meta=False)
            lora_b = _materialize(module.lora_B.weight, meta=False)
            full = merge_lora_weight(full, lora_a, lora_b, float(module.scale))
        for hf_name, piece in to_hf_tensors(name, full):
            dtype = refit_tensor_dtype(hf_name, piece, target_dtype, keep_fp32=keep_fp32)
            yield RefitSource(prefix + hf_name, piece, dtype)


def iter_refit_sources(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
    meta: bool = False,
) -> Iterator[RefitSource]:
    """Uncast refit sources in send order; ``meta=True`` yields meta stand-ins (for metadata).

    Every rank of a sharded model must iterate this together (DTensor gathers are collective).
    """
    keep = keep_fp32_patterns(model) if keep_fp32 is None else tuple(keep_fp32)
    with torch.no_grad():
        yield from _iter_one_model(model, target_dtype, keep_fp32=keep, prefix="", meta=meta)
        if draft_model is not None:
            draft_keep = keep_fp32_patterns(draft_model)
            yield from _iter_one_model(draft_model, target_dtype, keep_fp32=draft_keep, prefix=DRAFT_PREFIX, meta=meta)


def params_generator(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs in send order, each cast to its refit dtype and contiguous."""
    for source in iter_refit_sources(model, target_dtype, draft_model, keep_fp32=keep_fp32):
        yield source.name, source.tensor.to(source.dtype).contiguous()


def refit_specs(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
) -> list[TensorSpec]:
    """The wire specs of the stream (same walk as ``params_generator``, over meta tensors)."""
    return [s.spec for s in iter_refit_sources(model, target_dtype, draft_model, keep_fp32=keep_fp32, meta=True)]


def refit_info(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{hf_name: (shape, dtype)}`` in send order: exactly what ``params_generator`` sends."""
    specs = refit_specs(model, target_dtype, draft_model, keep_fp32=keep_fp32)
    return {s.name: (torch.Size(s.shape), s.dtype) for s in specs}

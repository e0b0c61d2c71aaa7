"""FP8 (e4m3) scale calibration of the attention projections: observe, gather, take percentiles.

Forward hooks on the q/k/v projections collect |activation| samples of the valid tokens of every
microbatch; every rank's samples are gathered (dp ranks hold other rows, TP ranks other heads),
so the percentile is the single-process one and the result is identical on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

import policyworker.shell.worker.inference as inference
import policyworker.shell.worker.microbatches as mbatch
from policyworker.functional.fp8 import kv_scales
from policyworker.functional.padding import mask_from_lengths
from policyworker.shell.worker.state import WorkerState

__all__ = ["calibrate_qkv_fp8_scales"]


def calibrate_qkv_fp8_scales(
    state: WorkerState,
    data: Mapping[str, Any],
    micro_batch_size: int | None,
    *,
    percentile: float,
    margin: float,
    include_q: bool,
) -> dict[str, Any]:
    """Per-attention-layer FP8 (e4m3) scales: percentile(|k|, |v|[, |q|]) * margin / 448."""
    projs = ("q_proj", "k_proj", "v_proj") if include_q else ("k_proj", "v_proj")
    samples: dict[tuple[str, str], list[torch.Tensor]] = {}
    current: dict[str, torch.Tensor] = {}
    handles = []

    def sampler(key: tuple[str, str]) -> Any:
        def hook(_m: Any, _inp: Any, out: torch.Tensor) -> None:
            valid = current["valid"].reshape(-1)
            flat = out.detach().float().reshape(valid.shape[0], -1)[valid]
            samples.setdefault(key, []).append(flat.abs().reshape(-1).cpu())

        return hook

    for name, module in state.model.named_modules():
        layer, _, leaf = name.rpartition(".")
        if leaf in projs:
            handles.append(module.register_forward_hook(sampler((layer, leaf[0]))))
    if not handles:
        msg = (
            # nn.Module's __getattr__ types sub-attributes as Tensor | Module; this is an HF model.
            f"model_type {state.model.config.model_type!r} has no q_proj/k_proj/v_proj "  # pyright: ignore[reportAttributeAccessIssue]
            f"modules to calibrate"
        )
        raise ValueError(msg)

    def per_mb(mb: mbatch.Microbatch) -> torch.Tensor:
        valid = mask_from_lengths(mb.lengths, mb.width).to(state.device)
        packed_all = torch.ones_like(mb.input_ids, dtype=torch.bool)
        current["valid"] = packed_all if mb.packed else valid
        mbatch.forward(state, mb)
        return valid.float()

    try:
        inference.run(state, data, micro_batch_size, per_mb)
    finally:
        for h in handles:
            h.remove()
    gathered = _gather_samples(state, {key: torch.cat(parts) for key, parts in samples.items()})
    layers = kv_scales(gathered, percentile, margin)
    flat = {f"{layer}.{key}": v for layer, d in layers.items() for key, v in d.items()}
    return {
        "format": "fp8_e4m3",
        "percentile": percentile,
        "margin": margin,
        "layers": layers,
        "kv_scales": flat,
    }


def _gather_samples(state: WorkerState, local: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
    """Concatenate every rank's samples per key (dp ranks hold other rows, TP ranks other
    heads), so the percentile is the single-process one and identical on every rank."""
    if state.parallel.world_size == 1:
        return local
    everyone: list[Any] = [None] * state.parallel.world_size
    dist.all_gather_object(everyone, local, group=state.parallel.groups["world"])
    return {
        key: torch.cat([part[key] for part in everyone if key in part])
        for key in sorted({k for part in everyone for k in part})
    }

"""FP8 (e4m3) scale arithmetic: a percentile of observed |activations| over the format's range.

``scale = max(percentile(|x|), 1e-12) * margin / 448`` where 448 is the largest finite e4m3
value, so the chosen percentile of the calibration activations maps to ``448 / margin``.
"""

import math

import torch

__all__ = ["FP8_E4M3_MAX", "fp8_e4m3_scale", "kv_scales"]

FP8_E4M3_MAX = 448.0
_MIN_AMAX = 1e-12


def fp8_e4m3_scale(abs_values_N: torch.Tensor, percentile: float, margin: float) -> float:
    """The e4m3 scale of 1-D non-negative samples: the ``percentile`` (in (0, 100]) by rank
    ``ceil(p / 100 * N)`` (the max at 100), times ``margin``, over 448. No samples: the floor."""
    if not 0.0 < percentile <= 100.0 or margin <= 0:
        msg = f"percentile={percentile} must be in (0, 100] and margin={margin} > 0"
        raise ValueError(msg)
    amax = 0.0
    if abs_values_N.numel():
        rank = max(1, math.ceil(percentile / 100.0 * abs_values_N.numel()))
        amax = float(abs_values_N.kthvalue(rank).values)
    return max(amax, _MIN_AMAX) * margin / FP8_E4M3_MAX


def kv_scales(
    samples: dict[tuple[str, str], torch.Tensor], percentile: float, margin: float
) -> dict[str, dict[str, float]]:
    """``{layer: {"k_scale": ..., "v_scale": ...[, "q_scale"]}}`` from samples keyed by
    ``(layer, "k" | "v" | "q")``, layers in sorted order."""
    layers: dict[str, dict[str, float]] = {}
    for (layer, kind), values in sorted(samples.items()):
        layers.setdefault(layer, {})[f"{kind}_scale"] = fp8_e4m3_scale(values, percentile, margin)
    return layers

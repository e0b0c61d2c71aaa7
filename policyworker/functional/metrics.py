"""How per-microbatch loss metrics combine into per-step numbers (all functions are pure).

A loss reports each microbatch's metrics already divided by the *global* valid-token or
valid-sequence count, so most metrics **add up** across microbatches, packed sequences and
data-parallel ranks. The exceptions are extremes (a key containing ``_min`` or ``_max``, e.g.
``probs_ratio_min``, which use ±inf as "no valid token here") and per-step constants that the
worker appends to every microbatch (``lr``, ``wd``, ``global_valid_seqs``,
``global_valid_toks``), which are averaged.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, SupportsFloat, cast

__all__ = [
    "MEAN_KEYS",
    "advertised_reductions",
    "aggregate_microbatch_metrics",
    "combine_packed_sequence_metrics",
    "flatten_train_metrics",
    "metric_reduction",
    "normalize_deferred_metrics",
    "scale_microbatch_metrics",
]

MEAN_KEYS = frozenset({"lr", "wd", "global_valid_seqs", "global_valid_toks"})
NO_FINITE_EXTREME = -1.0  # what an extreme aggregates to when no microbatch had a valid token

Reduction = Literal["min", "max", "mean", "sum"]


def metric_reduction(key: str, normalizer: str | None = None) -> Reduction:
    """How ``key`` combines across microbatches: min / max (extremes), mean, or sum.

    ``normalizer`` is what the loss advertised for it (``MetricNormalizer``'s value): a metric
    divided by a global count (``tokens``/``sequences``) is a share of the global batch and
    sums, whatever its name; otherwise (``none``, or not advertised) the name decides.
    """
    if normalizer in ("tokens", "sequences"):
        return "sum"
    if "_min" in key:
        return "min"
    if "_max" in key:
        return "max"
    return "mean" if key in MEAN_KEYS else "sum"


def advertised_reductions(normalizations: Mapping[str, str]) -> dict[str, Reduction]:
    """``{metric: reduction}`` for the metrics a loss advertised (see ``metric_reduction``)."""
    return {key: metric_reduction(key, str(norm)) for key, norm in normalizations.items()}


def _reduction(key: str, reductions: Mapping[str, Reduction] | None) -> Reduction:
    if reductions is not None and key in reductions:
        return reductions[key]
    return metric_reduction(key)


def scale_microbatch_metrics(
    metrics: Mapping[str, SupportsFloat],
    num_global_batches: int,
    *,
    reductions: Mapping[str, Reduction] | None = None,
) -> dict[str, float]:
    """Divide every metric but the extremes by ``num_global_batches`` (returns a new dict).

    Summing the scaled metrics of every microbatch of every global batch then gives the average
    over global batches. ``reductions`` (``advertised_reductions`` of the loss) overrides the
    name rule per metric.

    Raises:
        ValueError: if ``num_global_batches`` is not a positive int.
    """
    # the annotation is a promise; this value comes from a user's config
    if (
        isinstance(num_global_batches, bool)
        # a config value may break the annotation, so pyright's "always an int" is not true here
        or not isinstance(num_global_batches, int)  # pyright: ignore[reportUnnecessaryIsInstance]
        or num_global_batches < 1
    ):
        msg = f"num_global_batches must be a positive int, got {num_global_batches!r}"
        raise ValueError(msg)
    return {
        key: float(value)
        if _reduction(key, reductions) in ("min", "max")
        else float(value) / num_global_batches
        for key, value in metrics.items()
    }


def _finite(values: Iterable[SupportsFloat]) -> list[float]:
    return [v for v in map(float, values) if math.isfinite(v)]


def aggregate_microbatch_metrics(
    all_mb_metrics: Mapping[str, Sequence[SupportsFloat]],
    *,
    reductions: Mapping[str, Reduction] | None = None,
) -> dict[str, float]:
    """Reduce ``{key: [per-microbatch values]}`` to one number per key (NeMo-RL's rules).

    Extremes: min / max over finite values, ``-1.0`` when none is finite; ``lr``, ``wd``,
    ``global_valid_seqs``, ``global_valid_toks``: mean; everything else: sum. A key with an
    empty list is left out of the result (there is nothing to report). ``reductions``
    (``advertised_reductions`` of the loss) overrides the name rule per metric.
    """
    result: dict[str, float] = {}
    for key, values in all_mb_metrics.items():
        if len(values) == 0:
            continue
        reduction = _reduction(key, reductions)
        if reduction in ("min", "max"):
            finite = _finite(values)
            pick = min if reduction == "min" else max
            result[key] = pick(finite) if finite else NO_FINITE_EXTREME
        elif reduction == "mean":
            result[key] = math.fsum(map(float, values)) / len(values)
        else:
            result[key] = math.fsum(map(float, values))
    return result


def combine_packed_sequence_metrics(
    metrics_per_sequence: Sequence[Mapping[str, SupportsFloat]],
) -> dict[str, float]:
    """Combine the metrics of the sequences of one packed microbatch into that microbatch's.

    Sums every key except extremes, which take the min / max over finite values and stay at
    their sentinel (+inf for ``_min``, −inf for ``_max``) when no sequence had a valid token.
    Keys missing from some sequences combine over the sequences that have them.
    """
    combined: dict[str, float] = {}
    for metrics in metrics_per_sequence:
        for key, raw in metrics.items():
            value, reduction = float(raw), metric_reduction(key)
            if reduction == "min":
                start = combined.get(key, math.inf)
                combined[key] = min(start, value) if math.isfinite(value) else start
            elif reduction == "max":
                start = combined.get(key, -math.inf)
                combined[key] = max(start, value) if math.isfinite(value) else start
            else:
                combined[key] = combined.get(key, 0.0) + value
    return combined


# train() result keys that describe the call rather than measure it: no logger wants them.
_NOT_METRICS = frozenset({"rank", "model_dtype", "all_mb_metrics", "metric_reductions"})


def _as_float(value: Any) -> float | None:
    """One float for a number or a tensor/array of numbers (their mean); None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and hasattr(value, "dtype"):  # a torch tensor (no torch import needed)
        if numel() == 0 or value.dtype.is_complex:
            return None
        return float(value.detach().double().mean())
    if isinstance(value, Sequence) and not isinstance(value, str | bytes) and value:
        items = [_as_float(v) for v in cast("Sequence[object]", value)]
        floats = [v for v in items if v is not None]
        if len(floats) != len(items):
            return None
        return math.fsum(floats) / len(floats)
    return None


def flatten_train_metrics(result: Mapping[str, Any], *, prefix: str = "") -> dict[str, float]:
    """``PolicyWorker.train()``'s result as ``{name: float}``, ready for wandb / TensorBoard.

    ``all_mb_metrics`` is reduced as ``aggregate_microbatch_metrics`` does (one number per
    metric, at the top level, by the loss's ``metric_reductions`` when the result has them);
    ``global_loss`` (one loss per global batch) becomes its mean; ``grad_norm`` and
    ``skipped_steps`` become floats; ``rank`` and ``model_dtype`` and any value that is not a
    number (``None``, a dtype, a string) are left out. ``prefix`` is prepended to
    every name (e.g. ``"train/"``).
    """
    flat: dict[str, float] = {}
    for key, value in result.items():
        if key in _NOT_METRICS:
            continue
        number = _as_float(value)
        if number is not None:
            flat[key] = number
    reductions = result.get("metric_reductions")
    aggregated = aggregate_microbatch_metrics(
        result.get("all_mb_metrics") or {}, reductions=reductions
    )
    for key, value in aggregated.items():
        flat.setdefault(key, value)
    return {f"{prefix}{key}": value for key, value in flat.items()}


def normalize_deferred_metrics(
    metrics: Mapping[str, SupportsFloat],
    normalizations: Mapping[str, str],
    *,
    valid_toks: float,
    valid_seqs: float,
    token_level: bool,
) -> dict[str, float]:
    """One microbatch's metrics computed with both global counts set to 1, divided by the true
    ones once they are known (a train step split over several calls learns them at its end).

    A metric the loss advertised as ``tokens`` / ``sequences`` is divided by ``valid_toks`` /
    ``valid_seqs``; ``none`` and the extremes (``_min`` / ``_max`` in the name) stay as they
    are; a metric not advertised is divided by the loss's own normalizer (``valid_toks`` when
    ``token_level``, else ``valid_seqs``), as its gradient is. A zero count divides by 1 (the
    step has nothing to normalize). Exact for losses linear in ``1 / count``
    (``masked_mean``); returns a new dict.
    """
    toks = valid_toks if valid_toks > 0 else 1.0
    seqs = valid_seqs if valid_seqs > 0 else 1.0
    by_kind = {"tokens": toks, "sequences": seqs}
    out: dict[str, float] = {}
    for key, value in metrics.items():
        kind = str(normalizations[key]) if key in normalizations else None
        if "_min" in key or "_max" in key or kind == "none":
            out[key] = float(value)
        else:
            divisor = by_kind.get(kind or "", toks if token_level else seqs)
            out[key] = float(value) / divisor
    return out

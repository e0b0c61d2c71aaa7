"""The rows of a train-step run: our packed and padded steps against the plain Hugging Face
loop, MFU against its target, the planner's predicted peak beside the measured one, and the
optional rows (another fusion mode, LoRA against full fine-tuning, our layer compile against
Liger's kernels, another optimizer, float8 linears against bf16). See `bench.train_step`."""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import ratio

__all__ = ["fp8_rows", "summary_rows"]

LIGER = "fusion none with Liger's RMSNorm/SwiGLU/RoPE and our fused logprobs"


def summary_rows(
    args: argparse.Namespace,
    target: float | None,
    packed: dict[str, Any],
    padded: dict[str, Any],
    base_small: dict[str, Any],
    base_full: dict[str, Any] | None,
    *,
    other: dict[str, Any] | None,
    lora: dict[str, Any] | None,
    liger: dict[str, Any] | None,
    other_optimizer: dict[str, Any] | None = None,
    fp8: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The row schema of one run (`bench.rows`); a result that is None adds no rows."""
    rows = [
        {
            "metric": f"packed tok/s (b{args.batch}) vs HF (b{args.baseline_batch})",
            "ours": packed["tokens_per_s"],
            "baseline": base_small.get("tokens_per_s"),
            "baseline_name": f"plain Hugging Face loop at b{args.baseline_batch}",
            "ratio": ratio(packed["tokens_per_s"], base_small.get("tokens_per_s")),
        },
        {
            "metric": "packed MFU",
            "ours": packed["mfu"],
            "baseline": base_small.get("mfu"),
            "baseline_name": f"plain Hugging Face loop at b{args.baseline_batch}",
            "limit": None if target is None else f">= {target:.2f} ({_run_kind(args)})",
            "ratio": None if target is None else ratio(packed["mfu"], target),
        },
        {
            "metric": "padded tok/s",
            "ours": padded.get("tokens_per_s"),
            "baseline": base_small.get("tokens_per_s"),
            "baseline_name": f"plain Hugging Face loop at b{args.baseline_batch}",
            "ratio": ratio(padded.get("tokens_per_s"), base_small.get("tokens_per_s")),
        },
        {
            "metric": "padded MFU",
            "ours": padded.get("mfu"),
            "baseline": base_small.get("mfu"),
            "baseline_name": f"plain Hugging Face loop at b{args.baseline_batch}",
        },
        {
            "metric": "peak GiB (packed / HF small batch)",
            "ours": packed["peak_gib"],
            "baseline": base_small.get("peak_gib"),
            "baseline_name": f"plain Hugging Face loop at b{args.baseline_batch}",
            "limit": "fits comfortably (< 139)",
            "ratio": ratio(packed["peak_gib"], base_small.get("peak_gib")),
        },
        _planned_row(packed, f"packed, {packed['optimizer']}"),
    ]
    if other_optimizer is not None:
        rows += optimizer_rows(packed, other_optimizer)
    if other is not None:
        rows.append(
            {
                "metric": f"packed tok/s, fusion {args.fuse} vs {args.also_fuse}",
                "ours": packed["tokens_per_s"],
                "baseline": other["tokens_per_s"],
                "baseline_name": f"the same worker with fusion {args.also_fuse}",
                "ratio": ratio(packed["tokens_per_s"], other["tokens_per_s"]),
            }
        )
        rows.append(
            {
                "metric": f"packed MFU, fusion {args.fuse} vs {args.also_fuse}",
                "ours": packed["mfu"],
                "baseline": other["mfu"],
                "baseline_name": f"the same worker with fusion {args.also_fuse}",
            }
        )
    if lora is not None:
        rows.append(
            {
                "metric": f"packed tok/s, LoRA dim {args.also_lora_dim} vs full fine-tuning",
                "ours": lora["tokens_per_s"],
                "baseline": packed["tokens_per_s"],
                "baseline_name": "full fine-tuning, the same worker",
                "limit": ">= 1.1x",
                "ratio": ratio(lora["tokens_per_s"], packed["tokens_per_s"]),
            }
        )
        rows.append(
            {
                "metric": "peak GiB, LoRA vs full fine-tuning",
                "ours": lora["peak_gib"],
                "baseline": packed["peak_gib"],
                "baseline_name": "full fine-tuning, the same worker",
                "ratio": ratio(lora["peak_gib"], packed["peak_gib"]),
            }
        )
    if liger is not None and "unavailable" in liger:
        rows.append({"metric": f"Liger's kernels: not measured ({liger['unavailable']})"})
    if liger is not None and "tokens_per_s" in liger:
        rows.append(
            {
                "metric": "packed tok/s, our layer compile (default) vs Liger's kernels "
                "(fusion none + Liger RMSNorm/SwiGLU/RoPE, our fused logprobs)",
                "ours": packed["tokens_per_s"],
                "baseline": liger["tokens_per_s"],
                "baseline_name": LIGER,
                "limit": "> baseline (keep the faster)",
                "ratio": ratio(packed["tokens_per_s"], liger["tokens_per_s"]),
            }
        )
        rows.append(  # the same model, weights and batch: a kernel that computes wrong shows here
            {
                "metric": "loss of the last timed step, default vs Liger's kernels",
                "ours": packed["loss"],
                "baseline": liger["loss"],
                "baseline_name": LIGER,
                "ratio": ratio(packed["loss"], liger["loss"]),
            }
        )
    if fp8 is not None:
        rows.extend(fp8_rows(args, packed, fp8))
    if base_full is not None:
        rows.append(
            {
                "metric": f"HF at b{args.batch}",
                "ours": packed["peak_gib"],
                "baseline": "OOM" if base_full["oom"] else base_full["peak_gib"],
                "baseline_name": f"plain Hugging Face loop at b{args.batch}",
                "limit": "peak GiB",
            }
        )
    return rows


def _planned_row(result: dict[str, Any], label: str) -> dict[str, Any]:
    """The planner's predicted peak of a train call beside the measured one (an upper bound
    here: the planner counts full microbatches and live gradients, the batch's bins are not
    all full)."""
    return {
        "metric": f"planned / measured peak GiB ({label})",
        "ours": result["planned_peak_gib"],
        "baseline": result["peak_gib"],
        "baseline_name": "torch.cuda.max_memory_allocated over the worker's life",
        "ratio": ratio(result["planned_peak_gib"], result["peak_gib"]),
    }


def optimizer_rows(packed: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    """`--optimizer`'s worker beside `--also-optimizer`'s (or the pre-flight's refusal of it)."""
    ours, theirs = packed["optimizer"], other["optimizer"]
    name = f"the same worker with {theirs}"
    if "refused" in other:
        return [{"metric": f"{theirs}: refused by the pre-flight check ({other['refused']})"}]
    return [
        {
            "metric": f"packed tok/s, {ours} vs {theirs}",
            "ours": packed["tokens_per_s"],
            "baseline": other["tokens_per_s"],
            "baseline_name": name,
            "ratio": ratio(packed["tokens_per_s"], other["tokens_per_s"]),
        },
        {
            "metric": f"packed MFU, {ours} vs {theirs}",
            "ours": packed["mfu"],
            "baseline": other["mfu"],
            "baseline_name": name,
        },
        {
            "metric": f"peak GiB, {ours} vs {theirs}",
            "ours": packed["peak_gib"],
            "baseline": other["peak_gib"],
            "baseline_name": name,
            "ratio": ratio(packed["peak_gib"], other["peak_gib"]),
        },
        {
            "metric": f"loss of the last timed step, {ours} vs {theirs}",
            "ours": packed["loss"],
            "baseline": other["loss"],
            "baseline_name": name,
            "ratio": ratio(packed["loss"], other["loss"]),
        },
        _planned_row(other, f"packed, {theirs}"),
    ]


def _run_kind(args: argparse.Namespace) -> str:
    """What the MFU target is for: the shape, and full fine-tuning where the 7B shape has its
    own target for it."""
    full_7b = args.shape == "7b" and not args.lora_dim
    return f"{args.shape} shape" + (", full fine-tuning" if full_7b else "")


def fp8_rows(
    args: argparse.Namespace, packed: dict[str, Any], fp8: dict[str, Any]
) -> list[dict[str, Any]]:
    """The float8 worker against the first row (the same config without `dtensor_cfg.fp8`)."""
    name = f"the same worker without fp8 ({args.precision} GEMMs)"
    return [
        {"metric": f"fp8 worker: {fp8['fp8_report']}"},
        {
            "metric": f"packed tok/s, fp8 {args.also_fp8} vs without",
            "ours": fp8["tokens_per_s"],
            "baseline": packed["tokens_per_s"],
            "baseline_name": name,
            "limit": ">= 1.25x",
            "ratio": ratio(fp8["tokens_per_s"], packed["tokens_per_s"]),
        },
        {
            "metric": "peak GiB, fp8 vs without",
            "ours": fp8["peak_gib"],
            "baseline": packed["peak_gib"],
            "baseline_name": name,
            "ratio": ratio(fp8["peak_gib"], packed["peak_gib"]),
        },
        {  # same weights, batch and steps: a wrong float8 path shows here (50 steps: fp8_loss)
            "metric": "loss of the last timed step, fp8 vs without",
            "ours": fp8["loss"],
            "baseline": packed["loss"],
            "baseline_name": name,
            "ratio": ratio(fp8["loss"], packed["loss"]),
        },
    ]

"""LoRA benchmark: train-step tokens/s (LoRA vs full fine-tuning) and refit merge cost.

Model: a randomly initialised Qwen2 with the 1.5B shape (hidden 1536, 28 layers, 12 heads,
2 KV heads, MLP 8960, vocab 151936, tied embeddings), fp32 master weights, bf16 autocast,
sdpa attention. Train step: forward, next-token cross-entropy, backward, AdamW step (plain torch
loop, no worker). LoRA: every linear layer except lm_head, dim 16, alpha 32, with
``lora_cfg.compute_dtype: float32`` (fp32 adapter matmuls) and with the default ``auto`` as the
worker resolves it under bf16 autocast (bf16 adapter matmuls on CUDA, fp32 on CPU); the adapter
parameters are fp32 in both. With bf16 adapters the layers merge the adapter into the frozen
weight (one GEMM, `shell.lora._MergedAdapterLinear`); the row "adapters apart" runs the same
model on the path before that (base GEMM, adapter GEMMs, addmm) for the A/B.

Refit cost: producing every refit tensor in bf16 from the fp32 master weights; LoRA modules
go through ``merge_lora_weight`` (the exact fp32-accumulated merge) before the cast, the
baseline only casts (a full-weight refit's copy).

Merge kernel (CUDA only): one layer's merge + cast to bf16 under torch.compile, as a compiled
decoder layer runs it, at the shape's MLP weight ([intermediate, hidden]): ours is
``merge_lora_weight`` (an fp32 GEMM with W as its accumulator, then the cast); the baseline is
the same merge written as a sum over R of broadcast products (what compiled layers ran before
commit 8a1796c, inductor's reduction fused with the cast); the limit is one fp32 read of W and
one bf16 write at this GPU's copy rate, measured in the same run
(`common.copy_ceiling_bytes_per_s`).

    python -m bench.lora                  # on a GPU: prints a table, writes bench_lora.json
    python -m bench.lora --small          # CPU smoke run on a tiny shape (seconds)
"""

import argparse
import contextlib
import functools
import gc
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import (
    QWEN25_15B,
    TINY,
    copy_ceiling_bytes_per_s,
    device_seconds_per_call,
)
from bench.rows import row, write_result
from policyworker.functional.lora import merge_lora_weight
from policyworker.shell.model import (
    LinearLoRA,
    apply_lora,
    lora_modules,
    lora_parameters,
    resolve_compute_dtype,
)
from policyworker.testing import tiny_model

SHAPE_1P5B, SHAPE_SMALL = QWEN25_15B, TINY  # bench/common.py's shapes
LORA_CFG = {"match_all_linear": True, "dim": 16, "alpha": 32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(shape: dict, device: torch.device) -> torch.nn.Module:
    return tiny_model("qwen2", device=device, attn_implementation="sdpa", **shape).train()


def _train_tokens_per_s(model, params, *, device, batch, seq, steps, warmup) -> dict:
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    vocab = model.config.vocab_size
    tokens = torch.randint(
        0, vocab, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits, loss
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    )
    del optimizer
    return {
        "step_s": step_s,
        "tokens_per_s": batch * seq / step_s,
        "peak_mem_gib": peak,
        "trainable_params": sum(p.numel() for p in params),
    }


@contextlib.contextmanager
def _adapters_kept_apart():
    """LinearLoRA as before the merged path: no layer merges its adapter into the base weight."""
    merges = LinearLoRA._merges
    LinearLoRA._merges = lambda self: False  # the A/B switch, restored below
    try:
        yield
    finally:
        LinearLoRA._merges = merges


def _refit_s(model, *, device, merge: bool, repeats: int) -> float:
    """Seconds to produce every refit tensor (bf16) once; LoRA weights merged when ``merge``."""
    modules = lora_modules(model) if merge else {}
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for key, tensor in state.items():
            module = modules.get(key.removesuffix(".weight")) if key.endswith(".weight") else None
            if module is not None:
                tensor = merge_lora_weight(
                    tensor, module.lora_A.weight, module.lora_B.weight, module.scale
                )
            out = tensor.to(torch.bfloat16)
            del out
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _merge_by_reduction(
    weight_OI: torch.Tensor, lora_a_RI: torch.Tensor, lora_b_OR: torch.Tensor, scale: float
) -> torch.Tensor:
    """The merge compiled layers ran before 8a1796c: the baseline of the merge-kernel row."""
    products_ORI = lora_b_OR[:, :, None] * lora_a_RI[None, :, :]
    return weight_OI + scale * products_ORI.sum(dim=1)


def _compiled_merge_us(shape: dict, device: torch.device, repeats: int) -> dict | None:
    """Microseconds per compiled merge + bf16 cast of one [intermediate, hidden] LoRA weight:
    ours (GEMM), the reduction baseline, the memory limit, and whether ours equals eager."""
    if device.type != "cuda":
        return None
    out_features, in_features = shape["intermediate_size"], shape["hidden_size"]
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(out_features, in_features, device=device, generator=gen)
    lora_a = torch.randn(LORA_CFG["dim"], in_features, device=device, generator=gen) * 0.01
    lora_b = torch.randn(out_features, LORA_CFG["dim"], device=device, generator=gen) * 0.01
    scale = LORA_CFG["alpha"] / LORA_CFG["dim"]
    variants = {
        "gemm": lambda w, a, b: merge_lora_weight(w, a, b, scale).to(torch.bfloat16),
        "reduction": lambda w, a, b: _merge_by_reduction(w, a, b, scale).to(torch.bfloat16),
    }
    result: dict = {"shape": [out_features, in_features]}
    for name, fn in variants.items():
        compiled = torch.compile(fn)
        for _ in range(3):
            compiled(weight, lora_a, lora_b)
        seconds = device_seconds_per_call(
            lambda c=compiled: c(weight, lora_a, lora_b), calls=20 * repeats
        )
        result[f"{name}_us"] = seconds * 1e6
        if name == "gemm":
            eager = fn(weight, lora_a, lora_b)
            result["gemm_equals_eager"] = bool(torch.equal(compiled(weight, lora_a, lora_b), eager))
    result["copy_ceiling_bytes_per_s"] = copy_rate = copy_ceiling_bytes_per_s()
    result["limit_us"] = weight.numel() * (4 + 2) / copy_rate * 1e6
    return result


def run(
    *,
    small: bool,
    device: torch.device,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    repeats: int,
) -> dict:
    shape = SHAPE_SMALL if small else SHAPE_1P5B
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": shape,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "lora_cfg": LORA_CFG,
        "torch": torch.__version__,
    }
    model = _build(shape, device)
    train = functools.partial(
        _train_tokens_per_s, device=device, batch=batch, seq=seq, steps=steps, warmup=warmup
    )
    results["full_ft"] = train(model, [p for p in model.parameters()])
    results["full_refit_s"] = _refit_s(model, device=device, merge=False, repeats=repeats)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = _build(shape, device)
    names = apply_lora(model, {**LORA_CFG, "compute_dtype": "float32"})
    results["lora_modules"] = len(names)
    results["lora"] = train(model, lora_parameters(model))  # compute_dtype: float32
    results["lora_refit_s"] = _refit_s(model, device=device, merge=True, repeats=repeats)
    results["lora_refit_no_merge_s"] = _refit_s(model, device=device, merge=False, repeats=repeats)
    # the same model with compute_dtype "auto", resolved as the worker does under bf16 autocast
    auto = resolve_compute_dtype("auto", device=device, base_dtype=torch.bfloat16)
    for module in lora_modules(model).values():
        module.compute_dtype = auto
    results["lora_auto_compute_dtype"] = str(auto).removeprefix("torch.")
    results["lora_bf16_adapters"] = train(model, lora_parameters(model))
    with _adapters_kept_apart():
        results["lora_bf16_adapters_apart"] = train(model, lora_parameters(model))
    results["merged_vs_apart_tokens_per_s"] = (
        results["lora_bf16_adapters"]["tokens_per_s"]
        / results["lora_bf16_adapters_apart"]["tokens_per_s"]
    )
    results["speedup_tokens_per_s"] = (
        results["lora"]["tokens_per_s"] / results["full_ft"]["tokens_per_s"]
    )
    results["speedup_default_tokens_per_s"] = (
        results["lora_bf16_adapters"]["tokens_per_s"] / results["full_ft"]["tokens_per_s"]
    )
    results["merge_overhead_ratio"] = results["lora_refit_s"] / results["lora_refit_no_merge_s"]
    results["compiled_merge"] = _compiled_merge_us(shape, device, repeats)
    return results


def summary_rows(r: dict) -> list[dict]:
    """The row schema: LoRA against full fine-tuning in tokens/s, the merge at refit against a
    cast alone, and (CUDA) the compiled merge against the reduction it replaced and the memory
    limit."""
    full = r["full_ft"]["tokens_per_s"]
    rows = [
        row(
            f"train tokens/s, LoRA ({label}) vs full fine-tuning",
            r[key]["tokens_per_s"],
            unit="tok/s",
            baseline=full,
            baseline_name="full fine-tuning, same model and batch",
            target=target,
        )
        for label, key, target in (
            ("default compute_dtype", "lora_bf16_adapters", ">= 1.1x"),
            ("fp32 adapters", "lora", ""),
        )
    ]
    rows.append(
        row(
            "refit tensors, LoRA merge+cast vs cast only",
            r["lora_refit_s"] * 1e3,
            unit="ms",
            baseline=r["lora_refit_no_merge_s"] * 1e3,
            baseline_name="the same model's tensors cast without the merge",
        )
    )
    merge = r.get("compiled_merge")  # CUDA runs only
    if merge is not None:
        rows.append(
            row(
                f"compiled LoRA merge + cast {merge['shape']}, GEMM vs reduction (before)",
                merge["gemm_us"],
                unit="us",
                baseline=merge["reduction_us"],
                baseline_name="the merge as a sum of broadcast products",
                limit=merge["limit_us"],
            )
        )
    return rows


def _table(r: dict) -> str:
    rows = [
        (
            "train step",
            "full fine-tuning",
            f"{r['full_ft']['tokens_per_s']:,.0f} tok/s",
            f"{r['full_ft']['step_s'] * 1e3:.1f} ms",
            f"{r['full_ft']['peak_mem_gib']:.1f} GiB",
        ),
        (
            "train step",
            f"LoRA ({r['lora_modules']} modules), fp32",
            f"{r['lora']['tokens_per_s']:,.0f} tok/s",
            f"{r['lora']['step_s'] * 1e3:.1f} ms",
            f"{r['lora']['peak_mem_gib']:.1f} GiB",
        ),
        (
            "train step",
            f"LoRA, compute_dtype auto ({r['lora_auto_compute_dtype']})",
            f"{r['lora_bf16_adapters']['tokens_per_s']:,.0f} tok/s",
            f"{r['lora_bf16_adapters']['step_s'] * 1e3:.1f} ms",
            f"{r['lora_bf16_adapters']['peak_mem_gib']:.1f} GiB",
        ),
        (
            "train step",
            "LoRA, auto, adapters apart (before)",
            f"{r['lora_bf16_adapters_apart']['tokens_per_s']:,.0f} tok/s",
            f"{r['lora_bf16_adapters_apart']['step_s'] * 1e3:.1f} ms",
            f"{r['lora_bf16_adapters_apart']['peak_mem_gib']:.1f} GiB",
        ),
        (
            "refit tensors",
            "full weights (cast to bf16)",
            "",
            f"{r['full_refit_s'] * 1e3:.1f} ms",
            "",
        ),
        ("refit tensors", "LoRA, merged + cast", "", f"{r['lora_refit_s'] * 1e3:.1f} ms", ""),
        (
            "refit tensors",
            "LoRA model, cast only",
            "",
            f"{r['lora_refit_no_merge_s'] * 1e3:.1f} ms",
            "",
        ),
    ]
    merge = r.get("compiled_merge")
    if merge is not None:
        rows += [
            ("merge kernel", f"compiled {merge['shape']}: {variant}", "", f"{us:.1f} us", "")
            for variant, us in (
                ("GEMM + cast (ours)", merge["gemm_us"]),
                ("reduction (before)", merge["reduction_us"]),
                ("memory limit", merge["limit_us"]),
            )
        ]
    lines = [f"{'what':<14} {'variant':<38} {'throughput':>18} {'time':>12} {'peak mem':>10}"]
    lines += [f"{a:<14} {b:<38} {c:>18} {d:>12} {e:>10}" for a, b, c, d, e in rows]
    lines.append(
        f"LoRA / full tokens/s: fp32 adapters {r['speedup_tokens_per_s']:.2f}x, default (auto) "
        f"{r['speedup_default_tokens_per_s']:.2f}x; auto merged vs apart "
        f"{r['merged_vs_apart_tokens_per_s']:.2f}x; merge overhead at refit = "
        f"{r['merge_overhead_ratio']:.2f}x of a cast-only pass"
    )
    if merge is not None:
        lines.append(
            f"compiled merge: GEMM {merge['reduction_us'] / merge['gemm_us']:.2f}x faster than "
            f"the reduction, {merge['limit_us'] / merge['gemm_us']:.0%} of the memory limit; "
            f"bit-equal to eager: {merge['gemm_equals_eager']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shape on CPU (smoke test)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="bench_lora.json", help="where to write the results")
    args = parser.parse_args(argv)
    if args.small:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("the 1.5B benchmark needs a CUDA device; use --small for the CPU smoke run")
    settings = {
        "small": args.small,
        "batch": args.batch or (2 if args.small else 4),
        "seq": args.seq or (32 if args.small else 2048),
        "steps": args.steps or (2 if args.small else 8),
        "warmup": 1 if args.small else args.warmup,
        "repeats": 2 if args.small else args.repeats,
    }
    results = run(device=device, **settings)
    print(_table(results))
    write_result(args.json, {"rows": summary_rows(results), "settings": settings, **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

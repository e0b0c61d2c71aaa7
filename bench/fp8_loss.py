"""FP8 loss check: the loss trajectory of `dtensor_cfg.fp8` against bf16 over N steps.

Two packed workers from the same random checkpoint (Qwen2.5-1.5B shape by default, or
`--shape 7b --lora-dim 16`), each trained for `--steps` optimizer steps on the same batches in
the same order: batch t is `--batch` rows drawn (seed t) from a fixed pool of `--pool` random
sequences, so the model can learn the pool and the loss falls. The first worker computes in
bf16 (the default config), the second adds `dtensor_cfg.fp8` (recipe `--recipe`).

The noise floor is the bf16 run's step-to-step noise: the standard deviation over t of
``bf16[t+1] - bf16[t]``. Consecutive steps see different batches and slightly different
weights, so this is how much the loss moves between steps for reasons other than the
trend (the std removes the mean change, i.e. the trend). The check passes when the largest
``|fp8[t] - bf16[t]|`` over the run is within that noise: float8 moves the loss by less than
one step of ordinary batch-to-batch variation. Rows also give the mean |diff| and the last
losses. Reported beside the limit, never asserted.

Usage: `python -m bench.fp8_loss` (CUDA sm89+; `--small` is a CPU smoke run, where fp8 falls
back with one warning and both trajectories are equal). Writes bench/results/fp8_loss.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    SHAPES,
    device,
    make_batch,
    print_table,
    ratio,
    release,
    rl_lengths,
    save_random_model,
    write_results,
)
from policyworker import NLLLoss, PolicyWorker

__all__ = ["loss_noise", "main"]


def loss_noise(losses: list[float]) -> float:
    """The standard deviation of the step-to-step loss changes (0.0 for fewer than 3 steps)."""
    steps = [b - a for a, b in zip(losses, losses[1:], strict=False)]
    return statistics.stdev(steps) if len(steps) >= 2 else 0.0


def _config(model_path: str, args: argparse.Namespace, *, fp8: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_name": model_path,
        "precision": args.precision,
        "train_global_batch_size": args.batch,
        "train_micro_batch_size": 1,
        "max_grad_norm": 1.0,
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {"lr": args.lr, "weight_decay": 0.0, "fused": device().type == "cuda"},
        },
        "sequence_packing": {"train_mb_tokens": args.mb_tokens},
        "dtensor_cfg": {},
    }
    if args.lora_dim:
        cfg["dtensor_cfg"]["lora_cfg"] = {
            "dim": args.lora_dim,
            "alpha": 2 * args.lora_dim,
            "match_all_linear": True,
        }
    if fp8:
        cfg["dtensor_cfg"]["fp8"] = {"recipe": args.recipe}
    return cfg


def _batches(args: argparse.Namespace, vocab: int) -> list[dict[str, torch.Tensor]]:
    lengths = rl_lengths(args.pool, low=args.min_len, high=args.max_len, seed=0)
    pool = make_batch(lengths, vocab=vocab, seed=1, seq_len=args.max_len)
    out = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)
        rows = torch.randperm(args.pool, generator=gen)[: args.batch]
        out.append({k: v[rows] for k, v in pool.items()})
    return out


def _trajectory(
    model_path: str, args: argparse.Namespace, batches: list[dict], *, fp8: bool
) -> dict[str, Any]:
    release()
    torch.manual_seed(0)  # LoRA's A init and any dropout: the same draws in both runs
    worker = PolicyWorker(_config(model_path, args, fp8=fp8), init_reference_model=False)
    report = worker.float8_report.summary()
    print(
        f"{'fp8' if fp8 else 'bf16'} worker: fusion {worker.fusion_report.summary()}; fp8 {report}"
    )
    losses: list[float] = []
    start = time.perf_counter()
    try:
        for step, data in enumerate(batches):
            losses.append(float(worker.train(data, NLLLoss())["global_loss"][0]))
            if step % 10 == 0 or step == len(batches) - 1:
                print(f"  step {step}: loss {losses[-1]:.4f}")
    finally:
        worker.offload_after_refit()
        worker = None
        release()
    return {"losses": losses, "fp8_report": report, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model, short rows (CPU)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--lora-dim", type=int, default=0, help="LoRA on every linear (0: off)")
    parser.add_argument("--recipe", default="tensorwise", help="dtensor_cfg.fp8.recipe")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    parser.add_argument("--pool", type=int, default=16, help="distinct rows the batches draw")
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--mb-tokens", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.small:
        torch.set_num_threads(1)
        args.min_len, args.max_len, args.mb_tokens = 8, 32, 256
        args.steps = min(args.steps, 6)
        args.lr = max(args.lr, 1e-3)
    args.precision = args.precision or ("bfloat16" if device().type == "cuda" else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(Path(tmp) / "model")
        num_params = save_random_model(Path(model_path), small=args.small, shape=args.shape)
        vocab = 1024 if args.small else int(SHAPES[args.shape]["vocab_size"])
        batches = _batches(args, vocab)
        bf16 = _trajectory(model_path, args, batches, fp8=False)
        fp8 = _trajectory(model_path, args, batches, fp8=True)
    diffs = [abs(a - b) for a, b in zip(fp8["losses"], bf16["losses"], strict=True)]
    noise = loss_noise(bf16["losses"])
    baseline = f"bf16 step-to-step noise (std of consecutive loss changes, {args.steps} steps)"
    rows = [
        {"metric": f"fp8 worker: {fp8['fp8_report']}"},
        {
            "metric": f"max |loss fp8 - loss bf16| over {args.steps} steps",
            "ours": max(diffs),
            "baseline": noise,
            "baseline_name": baseline,
            "limit": "<= baseline",
            "ratio": ratio(max(diffs), noise),
        },
        {
            "metric": "mean |loss fp8 - loss bf16|",
            "ours": statistics.fmean(diffs),
            "baseline": noise,
            "baseline_name": baseline,
            "ratio": ratio(statistics.fmean(diffs), noise),
        },
        {
            "metric": f"last loss, fp8 vs bf16 (first bf16 loss: {bf16['losses'][0]:.4g})",
            "ours": fp8["losses"][-1],
            "baseline": bf16["losses"][-1],
            "baseline_name": "the bf16 run",
            "ratio": ratio(fp8["losses"][-1], bf16["losses"][-1]),
        },
    ]
    print_table(
        f"fp8 loss check, {num_params / 1e9:.2f}B params"
        + (f", LoRA dim {args.lora_dim}" if args.lora_dim else "")
        + f", {args.steps} steps of {args.batch} rows",
        rows,
    )
    write_results(
        "fp8_loss",
        {
            "num_params": num_params,
            "settings": vars(args),
            "bf16": bf16,
            "fp8": fp8,
            "abs_diffs": diffs,
            "noise": noise,
            "rows": rows,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
        args.out,
    )


if __name__ == "__main__":
    main()

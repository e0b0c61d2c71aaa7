"""Train-step benchmark: PolicyWorker packed vs padded vs a plain HF + torch loop, in one run.

Model: random Qwen2.5-1.5B shape (vocab 151936), fp32 master weights, bf16 compute. Batch:
`--batch` rows with lengths uniform in [--min-len, --max-len] (an RL mix). Reported per mode:
real (unpadded) tokens/s, MFU = 6 * N * real tokens / s / 790 TFLOP/s, and peak memory.

- ours (packed): `PolicyWorker.train` with sequence packing (varlen attention on CUDA) and the
  chunked logprob loss; one optimizer step per call.
- ours (padded): the same worker with fixed microbatches of `--padded-mbs` padded rows.
- baseline: plain HF forward under bf16 autocast (sdpa, padded rows of width max-len), full fp32
  logits + log_softmax, NLL, backward, AdamW step; at `--baseline-batch` rows and at `--batch`
  rows (an out-of-memory there is reported, not raised).

Usage: `python -m bench.train_step` (CUDA) or `python -m bench.train_step --small` (CPU smoke).
8B-class row: `--shape 7b --lora-dim 16 --skip-baseline` (Qwen2.5-7B shape, LoRA on
every linear layer; MFU counts 4 * N per token for the frozen base). With `--lora-dim`, a
plain-HF baseline (when not skipped) still trains every weight.
`--optimizer NAME` picks every worker's optimizer (default torch.optim.AdamW; kwargs from
`bench.train_step_settings.OPTIMIZER_KWARGS`, plus `--optimizer-kwargs JSON`);
`--also-optimizer NAME` measures one more packed worker with that optimizer on the same model and
batch, as a row beside the first (a
worker the pre-flight memory check refuses is a row saying so). 8B-class full fine-tuning:
`--shape 7b --optimizer torch.optim.Adafactor --mb-tokens 8192 --skip-baseline` (MFU 6 * N
per token); the same step with AdamW, everything on the GPU, fits the 1.5B shape:
`--optimizer torch.optim.AdamW --also-optimizer torch.optim.Adafactor`. Every worker row also
reports the planner's predicted peak (the larger of its train_step and optimizer_step phases)
beside the measured one.
`--fuse auto|none|norm_mlp|layer` sets `dtensor_cfg.fusion` (default `auto`, the config's default:
`layer` on CUDA, `none` on CPU; the compile happens in the worker's init probe and the untimed
warm-up step). `--also-fuse none` measures a second packed worker with that mode on the same
model and batch, as a row beside the first (e.g. the default vs eager); `--also-lora-dim 16` one
more, the default config with LoRA of that dim on every linear layer (LoRA vs full
fine-tuning row, through the worker as a user runs it); `--also-liger` one more, `fusion: none`
with Liger's Qwen2 kernels (RMSNorm, SwiGLU MLP, RoPE) patched into the worker's model and our
fused logprob kernels: the field's kernel library in place of our layer compile, everything else
equal (measure both, keep the better; CUDA only, Liger is Triton);
`--also-fp8 [RECIPE]` one more, the default config (and `--lora-dim`) plus `dtensor_cfg.fp8`
(torchao float8 matmuls in the decoder layers, recipe default tensorwise; CUDA sm89+): its
tokens/s against the first row's (target >= 1.25x) and the last timed step's loss beside it;
`--skip-padded` skips the padded worker.
`--profile` also prints where the first row's worker spends a step (top kernels, where the GPU
idles: `bench/gpu_gaps.py`, host time) and its speed after the profile; that worker then runs
after every other row, since a profile slows the rest of its process.
Prints a table (ours / baseline / limit / ratio) and writes bench/results/train_step.json.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import traceback
from pathlib import Path

import attrs
import torch

from bench.common import (
    SHAPES,
    device,
    gib,
    make_batch,
    mfu,
    peak_bytes,
    print_table,
    release,
    rl_lengths,
    save_random_model,
    timed,
    write_results,
)
from bench.gpu_gaps import print_call_profile
from bench.train_step_baselines import bench_plain_hf, liger_layers
from bench.train_step_rows import summary_rows
from bench.train_step_settings import (
    mfu_target,
    optimizer_section,
    set_inductor_options,
)
from policyworker import ConfigError, NLLLoss, PolicyWorker
from policyworker.functional.logprob_kernels import EAGER_KERNELS
from policyworker.shell.kernels import FUSION_MODES


def worker_config(
    model_path: str,
    args: argparse.Namespace,
    *,
    packed: bool,
    fuse: str | None = None,
    lora_dim: int = 0,
    optimizer: str | None = None,
    fp8: str | None = None,
) -> dict:
    cfg = {
        "model_name": model_path,
        "precision": args.precision,
        "train_global_batch_size": args.batch,
        "train_micro_batch_size": args.padded_mbs,
        "max_grad_norm": 1.0,
        "logprob_chunk_size": args.chunk,
        "optimizer": optimizer_section(optimizer or args.optimizer, args),
        "dtensor_cfg": {
            "activation_checkpointing": args.activation_checkpointing,
            "fusion": fuse or args.fuse,
        },
    }
    if lora_dim:
        cfg["dtensor_cfg"]["lora_cfg"] = {
            "dim": lora_dim,
            "alpha": 2 * lora_dim,
            "match_all_linear": True,
        }
    if fp8:
        cfg["dtensor_cfg"]["fp8"] = {"recipe": fp8}
    if packed:
        cfg["sequence_packing"] = {"train_mb_tokens": args.mb_tokens}
    return cfg


def bench_worker(
    model_path: str,
    args,
    data,
    num_params: int,
    *,
    packed: bool,
    fuse: str | None = None,
    lora_dim: int | None = None,
    profile: bool = False,
    liger: bool = False,
    optimizer: str | None = None,
    fp8: str | None = None,
) -> dict:
    """One worker's timed train steps; `liger`: `fusion: none` with Liger's kernels patched in
    (`liger_layers`) and our fused logprob kernels; `optimizer`: another than `--optimizer`."""
    lora_dim = args.lora_dim if lora_dim is None else lora_dim
    optimizer = optimizer or args.optimizer
    release()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    worker = PolicyWorker(
        worker_config(
            model_path,
            args,
            packed=packed,
            fuse="none" if liger else fuse,
            lora_dim=lora_dim,
            optimizer=optimizer,
            fp8=fp8,
        ),
        init_reference_model=False,
    )
    planned = planned_peak_bytes(worker)
    if args.eager_logprobs:
        worker.state.logprob_kernels = EAGER_KERNELS
    fusion = fusion_result(
        worker,
        "none + Liger" if liger else fuse or args.fuse,
        label=("packed" if packed else "padded")
        + (f", fusion {fuse}" if fuse else "")
        + (", fusion none + Liger's kernels" if liger else "")
        + (f", LoRA dim {lora_dim}" if lora_dim else "")
        + (f", fp8 {fp8}" if fp8 else ""),
        seconds=time.perf_counter() - start,
    )
    fp8_report = worker.float8_report.summary()
    if fp8:
        print(f"fp8 ({fp8}): {fp8_report}")
    tokens = int(data["input_lengths"].sum())
    after_profile_s = None
    try:
        with liger_layers(worker) if liger else contextlib.nullcontext():
            worker_logprobs = worker.state.logprob_kernels.name
            seconds, result = timed(lambda: worker.train(data, NLLLoss()), repeats=args.steps)
            if profile:
                print_call_profile(lambda: worker.train(data, NLLLoss()))
                # what the profiler leaves behind in this process (common.mark_profiled)
                after_profile_s, _ = timed(
                    lambda: worker.train(data, NLLLoss()),
                    repeats=args.steps,
                    warmup=0,
                    after_profile=True,
                )
                print(
                    f"after the profile: {tokens / after_profile_s:,.0f} tok/s "
                    f"(before: {tokens / seconds:,.0f})"
                )
    finally:
        peak = peak_bytes()
        worker.offload_after_refit()
        worker = None  # the last reference, so release() can return its memory
        release()
    return {
        "tokens_per_s": tokens / seconds,
        "mfu": mfu(num_params, tokens, seconds, flops_per_param=4.0 if lora_dim else 6.0),
        "lora_dim": lora_dim,
        "step_s": seconds,
        "peak_gib": gib(peak),
        "planned_peak_gib": gib(planned),
        "optimizer": optimizer,
        "loss": float(result["global_loss"][0]),
        "attn": "varlen" if packed and device().type == "cuda" else "sdpa",
        **fusion,
        "logprob_kernels": worker_logprobs,
        "fp8_report": fp8_report,
        "tokens_per_s_after_profile": tokens / after_profile_s if after_profile_s else None,
    }


def planned_peak_bytes(worker: PolicyWorker) -> int:
    """The planner's peak of a train call: the larger of its train_step and optimizer_step."""
    table = worker.plan_memory()
    return max(table["train_step"]["total_bytes"], table["optimizer_step"]["total_bytes"])


def optimizer_row(model_path: str, args, data, num_params: int) -> dict:
    """The `--also-optimizer` worker's result, or why the pre-flight memory check refused it
    (a refusal is a finding: that optimizer's state does not fit beside the step)."""
    try:
        return bench_worker(
            model_path, args, data, num_params, packed=True, optimizer=args.also_optimizer
        )
    except ConfigError as exc:
        release()
        return {"refused": str(exc)[:400], "optimizer": args.also_optimizer}


def liger_row(model_path: str, args, data, num_params: int) -> dict:
    """The Liger worker's result, or why there is none: Liger is Triton (CUDA only), and a
    failure of the field's library (its patching or kernels) costs this row, not the table."""
    if device().type != "cuda":
        return {"unavailable": "Liger's kernels are Triton (CUDA only)"}
    try:
        return bench_worker(model_path, args, data, num_params, packed=True, liger=True)
    except Exception as exc:
        traceback.print_exc()
        release()
        return {"unavailable": f"Liger's worker failed: {type(exc).__name__}: {exc}"[:300]}


def fusion_result(worker: PolicyWorker, mode: str, *, label: str, seconds: float) -> dict:
    """The worker's fusion report (its init ran the compile probe), printed and as result keys."""
    report = worker.fusion_report
    print(f"fusion ({label}): {report}; worker init {seconds:.1f} s")
    return {"fuse": mode, "fuse_report": attrs.asdict(report), "init_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model, short rows, CPU-friendly")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--baseline-batch", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument(
        "--mb-tokens", type=int, default=16384, help="packing capacity per microbatch"
    )
    parser.add_argument("--padded-mbs", type=int, default=2, help="rows per padded microbatch")
    parser.add_argument(
        "--chunk", type=int, default=None, help="logprob_chunk_size (default: by vocab)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--precision", default=None)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--skip-baseline-full-batch", action="store_true")
    parser.add_argument("--skip-baseline", action="store_true", help="measure ours only")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step of the first packed worker (top kernels, GPU idle, host "
        "time), timed again after it; that worker runs after every other row",
    )
    parser.add_argument(
        "--fuse",
        choices=FUSION_MODES,
        default=None,
        help="dtensor_cfg.fusion for the worker (default: auto = layer on CUDA, none on CPU)",
    )
    parser.add_argument(
        "--also-fuse",
        choices=FUSION_MODES,
        default=None,
        help="also measure a packed worker with this fusion mode (a row beside --fuse)",
    )
    parser.add_argument(
        "--also-lora-dim",
        type=int,
        default=0,
        help="also measure a packed worker (default fusion) with LoRA of this dim on every "
        "linear layer: a row of LoRA vs full fine-tuning tokens/s and peak memory",
    )
    parser.add_argument(
        "--also-liger",
        action="store_true",
        help="also measure a packed worker with fusion none, Liger's RMSNorm/SwiGLU/RoPE "
        "kernels and our fused logprob kernels: Liger's kernels against our compile (CUDA)",
    )
    parser.add_argument(
        "--also-fp8",
        nargs="?",
        const="tensorwise",
        default=None,
        metavar="RECIPE",
        help="also measure a packed worker with dtensor_cfg.fp8 (torchao float8 linears; recipe "
        "default tensorwise), otherwise the first row's config: fp8 vs bf16 tokens/s and loss",
    )
    parser.add_argument("--skip-padded", action="store_true", help="skip the padded worker")
    parser.add_argument(
        "--optimizer",
        default="torch.optim.AdamW",
        help="every worker's optimizer (a dotted class path), e.g. torch.optim.Adafactor",
    )
    parser.add_argument(
        "--optimizer-kwargs",
        default=None,
        metavar="JSON",
        help="extra optimizer kwargs over the bench's own, e.g. '{\"foreach\": true}'",
    )
    parser.add_argument(
        "--also-optimizer",
        default=None,
        help="also measure a packed worker with this optimizer (a row beside --optimizer's; "
        "a pre-flight refusal is reported as a row)",
    )
    parser.add_argument(
        "--eager-logprobs",
        action="store_true",
        help="score logits with the eager logprob kernels even where fusion compiles them (an "
        "A/B of shell.fused_logprobs)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="1.5b",
        help="model shape: 1.5b (Qwen2.5-1.5B) or 7b (Qwen2.5-7B, an 8B-class shape; use with "
        "--lora-dim and --skip-baseline on one GPU)",
    )
    parser.add_argument(
        "--lora-dim",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on every linear layer (0: full training); MFU "
        "then counts 4 * N FLOPs per token (frozen base)",
    )
    parser.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set torch._inductor.config.KEY (a Python literal) before any compile, e.g. "
        "combo_kernels=True; repeatable (an experiment knob: one process, one setting)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    set_inductor_options(args.inductor)
    if args.small:
        torch.set_num_threads(1)
        args.min_len, args.max_len, args.mb_tokens, args.steps = 8, 64, 256, 1
    args.precision = args.precision or ("bfloat16" if device().type == "cuda" else "float32")
    args.fuse = args.fuse or "auto"
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(Path(tmp) / "model")
        num_params = save_random_model(Path(model_path), small=args.small, shape=args.shape)
        vocab = 1024 if args.small else SHAPES[args.shape]["vocab_size"]
        lengths = rl_lengths(args.batch, low=args.min_len, high=args.max_len, seed=0)
        data = make_batch(lengths, vocab=vocab, seed=1, seq_len=args.max_len)
        # --profile: the first row's worker is profiled (the profiled calls and trace export
        # take a minute) and so runs after every other row: a profile slows every later launch
        # in its process (common.mark_profiled)
        packed = None
        if not args.profile:
            packed = bench_worker(model_path, args, data, num_params, packed=True)
            partial = {"partial": True, "num_params": num_params, "settings": vars(args)}
            write_results(  # if the run is cut short, its first row survives
                "train_step", {**partial, "ours_packed": packed, "rows": []}, args.out
            )
        other = (
            bench_worker(model_path, args, data, num_params, packed=True, fuse=args.also_fuse)
            if args.also_fuse
            else None
        )
        lora = (
            bench_worker(
                model_path, args, data, num_params, packed=True, lora_dim=args.also_lora_dim
            )
            if args.also_lora_dim
            else None
        )
        other_optimizer = (
            optimizer_row(model_path, args, data, num_params) if args.also_optimizer else None
        )
        fp8 = (
            bench_worker(model_path, args, data, num_params, packed=True, fp8=args.also_fp8)
            if args.also_fp8
            else None
        )
        liger = None
        if args.also_liger:
            liger = liger_row(model_path, args, data, num_params)
        padded = {}
        if not args.skip_padded:
            padded = bench_worker(model_path, args, data, num_params, packed=False)
        base_small = (
            {}
            if args.skip_baseline
            else bench_plain_hf(model_path, args, lengths[: args.baseline_batch], num_params)
        )
        base_full = (
            None
            if args.skip_baseline_full_batch or args.skip_baseline
            else bench_plain_hf(model_path, args, lengths, num_params)
        )
        if packed is None:
            packed = bench_worker(model_path, args, data, num_params, packed=True, profile=True)
    target = mfu_target(args)
    rows = summary_rows(
        args,
        target,
        packed,
        padded,
        base_small,
        base_full,
        other=other,
        lora=lora,
        liger=liger,
        other_optimizer=other_optimizer,
        fp8=fp8,
    )
    print_table(
        f"train step, {num_params / 1e9:.2f}B params, {args.batch} rows of "
        f"{args.min_len}..{args.max_len} tokens ({sum(lengths)} real), "
        f"{args.precision}, fusion={args.fuse}, optimizer={args.optimizer}",
        rows,
    )
    write_results(
        "train_step",
        {
            "num_params": num_params,
            "lengths": lengths,
            "settings": vars(args),
            "ours_packed": packed,
            "ours_packed_also_fuse": other,
            "ours_packed_lora": lora,
            "ours_packed_liger": liger,
            "ours_packed_also_optimizer": other_optimizer,
            "ours_packed_fp8": fp8,
            "ours_padded": padded,
            "baseline_small_batch": base_small,
            "baseline_full_batch": base_full,
            "mfu_target": target,
            "rows": rows,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
        args.out,
    )


if __name__ == "__main__":
    main()

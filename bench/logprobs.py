"""get_logprobs benchmark: PolicyWorker vs a plain forward + full fp32 log_softmax, in one run.

Model: random Qwen2.5-1.5B shape (vocab 151936), fp32 master weights, bf16 compute, sdpa.
For each token count in `--tokens` (rows of `--row-len` tokens): throughput (tokens/s, median
of `--repeats`) and the extra peak memory of the call beyond the resident weights.

- ours: `PolicyWorker.get_logprobs` with one microbatch of all rows: the LM head runs chunk by
  chunk over the hidden states, so no [T, V] logits tensor is ever materialized.
- baseline: the same weights in a plain HF model (eager, sdpa, loaded apart from the worker so
  `--fuse` changes only ours), `model(ids).logits.float()` -> `log_softmax` -> gather.
- liger (when `liger_kernel` is installed): the same plain model's body, then Liger's fused
  linear-cross-entropy (`reduction="none"`; logprob = -loss) over the hidden states, so its
  [T, V] logits exist only chunk by chunk too: the field's kernel library on the same shape.

At the first token count: `get_logprobs(data, entropy=True, top_k=20)` (the extras read from the
same LM-head chunks) against `get_logprobs` then `get_topk_logits` (what a user runs without
them: two forwards), and the logprobs alone, in time and extra peak memory.

On CUDA it also times the scoring kernels alone on one [1, T, V] bf16 block (T = the first
`--tokens`): the worker's Triton kernels (logprobs forward, backward, entropy) against
inductor's compile of the same functions.

Targets, each a row's rule: at 16k and 32k tokens throughput >= 1.5x the plain
path's and ahead of Liger's, extra peak memory <= 10 % of the plain path's.
Usage: `python -m bench.logprobs` (CUDA) or `python -m bench.logprobs --small` (CPU smoke);
`--fuse layer|norm_mlp` sets the worker's `dtensor_cfg.fusion`.
Prints a table (ours / baseline / limit / ratio) and writes bench/results/logprobs.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import (
    copy_ceiling_bytes_per_s,
    device,
    gib,
    is_oom,
    make_batch,
    peak_extra_bytes,
    print_table,
    ratio,
    release,
    save_random_model,
    timed,
    write_results,
)
from bench.gpu_gaps import print_profile
from policyworker import PolicyWorker
from policyworker.shell.kernels import FUSION_MODES
from policyworker.shell.model import autocast_context

MEMORY_LIMIT = 0.10  # of the plain path's extra peak
TOP_K = 20  # the extras row's k (a distillation teacher's usual top-k)
SPEEDUP_TARGET = 1.5  # x the plain path's throughput


def plain_logprobs(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        with autocast_context(ids.device, dtype):
            logits = model(input_ids=ids, use_cache=False).logits
        lp = torch.log_softmax(logits.float()[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp.cpu()


def liger_logprobs(model, ids: torch.Tensor, dtype: torch.dtype, fused_ce) -> torch.Tensor:
    with torch.no_grad(), autocast_context(ids.device, dtype):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
        losses = fused_ce(
            model.lm_head.weight.to(dtype),
            hidden.reshape(-1, hidden.shape[-1]).to(dtype),
            ids[:, 1:].reshape(-1),
        )
    return (-losses.float()).view(ids.shape[0], -1).cpu()


def liger_loss():
    """Liger's fused linear-cross-entropy per token, or None where it is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(reduction="none")


def kernel_rows(tokens: int, vocab: int, repeats: int) -> tuple[list[dict], dict]:
    """The scoring kernels alone on one [1, tokens, V] bf16 logits block: the worker's fused
    kernels on CUDA (`shell.logprob_triton`) against inductor's compile of the same functions
    (what the worker ran before), forward, backward and entropy, each beside the time one read
    (+ one write in backward) of the block takes at the measured copy ceiling."""
    from policyworker.shell.kernels import TRITON_KERNELS, inductor_kernels

    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    logits = (3 * torch.randn(1, tokens, vocab, generator=gen, device=cuda)).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen, device=cuda)
    grad = torch.randn(1, tokens, generator=gen, device=cuda)
    pairs = {"triton": TRITON_KERNELS, "inductor": inductor_kernels()}
    ms: dict[str, dict[str, float]] = {}
    for name, pair in pairs.items():
        fwd, (_, lse) = timed(lambda f=pair.forward: f(logits, ids, 1.0), repeats=repeats, warmup=2)
        bwd, _ = timed(
            lambda b=pair.backward, lse=lse: b(logits, ids, lse, grad, 1.0),
            repeats=repeats,
            warmup=2,
        )
        ent, _ = timed(lambda e=pair.entropy: e(logits, 1.0), repeats=repeats, warmup=2)
        ms[name] = {"forward_ms": fwd * 1e3, "backward_ms": bwd * 1e3, "entropy_ms": ent * 1e3}
    copy_rate = copy_ceiling_bytes_per_s()
    read_ms = logits.numel() * 2 / copy_rate * 1e3
    rows = [
        {
            "metric": f"{tokens} tok x {vocab} logits: {phase} kernel ms (Triton vs inductor)",
            "ours": ms["triton"][f"{phase}_ms"],
            "baseline": ms["inductor"][f"{phase}_ms"],
            "baseline_name": "the inductor-compiled kernels",
            "limit": f"{read_ms * passes:.2f} ms ({passes} pass{'es' if passes > 1 else ''} at "
            f"{copy_rate / 1e12:.2f} TB/s, this GPU's copy rate measured now)",
            "ratio": ratio(ms["inductor"][f"{phase}_ms"], ms["triton"][f"{phase}_ms"]),
        }
        for phase, passes in (("forward", 1), ("backward", 2), ("entropy", 1))
    ]
    return rows, {**ms, "copy_ceiling_bytes_per_s": copy_rate}


def extras_rows(worker, data, tokens: int, repeats: int, rows: list[dict]) -> dict:
    """get_logprobs(entropy=True, top_k=TOP_K): the extras read from the logprobs' own LM-head
    chunks, against the two calls a user makes without them (get_logprobs, then
    get_topk_logits: a second forward) and against logprobs alone; adds its rows to `rows`."""
    one_pass = measure(lambda: worker.get_logprobs(data, entropy=True, top_k=TOP_K), repeats)
    two_calls = measure(
        lambda: (worker.get_logprobs(data), worker.get_topk_logits(data, TOP_K)), repeats
    )
    alone = measure(lambda: worker.get_logprobs(data), repeats)
    seconds = {name: r.get("seconds") for name, r in (("one", one_pass), ("two", two_calls))}
    rows.append(
        {
            "metric": f"{tokens} tok: logprobs + entropy + top-{TOP_K}, one pass (ms) vs "
            f"get_logprobs then get_topk_logits",
            "ours": None if seconds["one"] is None else seconds["one"] * 1e3,
            "baseline": None if seconds["two"] is None else seconds["two"] * 1e3,
            "baseline_name": "get_logprobs, then get_topk_logits (two calls)",
            "limit": f"logprobs alone: {alone.get('seconds', float('nan')) * 1e3:.1f} ms",
            "ratio": ratio(seconds["two"], seconds["one"]),
        }
    )
    rows.append(
        {
            "metric": f"{tokens} tok: extra peak GiB, logprobs + entropy + top-{TOP_K}",
            "ours": one_pass.get("extra_peak_gib"),
            "baseline": two_calls.get("extra_peak_gib"),
            "baseline_name": "get_logprobs, then get_topk_logits (two calls)",
            "limit": f"logprobs alone: {alone.get('extra_peak_gib', float('nan')):.2f} GiB",
            "ratio": ratio(one_pass.get("extra_peak_gib"), two_calls.get("extra_peak_gib")),
        }
    )
    return {"one_pass": one_pass, "two_calls": two_calls, "logprobs_alone": alone}


def measure(fn, repeats: int) -> dict:
    try:
        extra, _ = peak_extra_bytes(fn)
        seconds, _ = timed(fn, repeats=repeats, warmup=0)
    except RuntimeError as exc:
        if not is_oom(exc):
            raise
        release()
        return {"oom": True}
    return {"oom": False, "seconds": seconds, "extra_peak_gib": gib(extra)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model, short rows, CPU-friendly")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--row-len", type=int, default=4096)
    parser.add_argument(
        "--chunk", type=int, default=None, help="logprob_chunk_size (default: by vocab)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default=None)
    parser.add_argument(
        "--fuse",
        choices=FUSION_MODES,
        default=None,
        help="dtensor_cfg.fusion for the worker (default: the config's default, auto)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one call of ours and of the plain path at the first token count, after "
        "every timed row",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.small:
        torch.set_num_threads(1)
        args.tokens, args.row_len, args.repeats = [128, 256], 64, 1
    args.precision = args.precision or ("bfloat16" if device().type == "cuda" else "float32")
    args.fuse = args.fuse or "auto"
    results, rows = [], []
    profiles = []  # run after every timed row: a profile slows its process (common.mark_profiled)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(Path(tmp) / "model")
        num_params = save_random_model(Path(model_path), small=args.small)
        worker = PolicyWorker(
            {
                "model_name": model_path,
                "precision": args.precision,
                "logprob_chunk_size": args.chunk,
                "logprob_batch_size": 1024,
                "dtensor_cfg": {"fusion": args.fuse},
            },
            init_optimizer=False,
            init_reference_model=False,
        )
        print(f"fusion: {worker.fusion_report}")
        plain = (
            transformers.AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch.float32, attn_implementation="sdpa"
            )
            .to(worker.device)
            .eval()
        )
        vocab = worker.model.config.vocab_size
        fused_ce = liger_loss() if worker.device.type == "cuda" else None  # Liger is Triton-only
        for tokens in args.tokens:
            num_rows = max(1, tokens // args.row_len)
            data = make_batch([args.row_len] * num_rows, vocab=vocab, seed=tokens)
            ids = data["input_ids"].to(worker.device)
            ours = measure(lambda data=data: worker.get_logprobs(data), args.repeats)
            base = measure(lambda ids=ids: plain_logprobs(plain, ids, worker.dtype), args.repeats)
            liger = (
                {"oom": False, "not_installed": True}
                if fused_ce is None
                else measure(
                    lambda ids=ids: liger_logprobs(plain, ids, worker.dtype, fused_ce), args.repeats
                )
            )
            real = num_rows * args.row_len
            for r in (ours, base, liger):
                if not r["oom"] and "seconds" in r:
                    r["tokens_per_s"] = real / r["seconds"]
            if not ours["oom"] and not base["oom"]:
                got = worker.get_logprobs(data)["logprobs"][:, 1:]
                want = plain_logprobs(plain, ids, worker.dtype)
                ours["max_abs_diff_vs_plain"] = float((got - want).abs().max())
                if "seconds" in liger:
                    lig = liger_logprobs(plain, ids, worker.dtype, fused_ce)
                    liger["max_abs_diff_vs_plain"] = float((lig - want).abs().max())
            results.append({"tokens": real, "ours": ours, "baseline": base, "liger": liger})
            if args.profile and tokens == args.tokens[0]:
                profiles = [
                    (f"ours, {real} tokens", lambda data=data: worker.get_logprobs(data)),
                    (
                        f"plain, {real} tokens",
                        lambda ids=ids: plain_logprobs(plain, ids, worker.dtype),
                    ),
                ]
            rows.append(
                {
                    "metric": f"{real} tok: tokens/s",
                    "ours": ours.get("tokens_per_s"),
                    "baseline": base.get("tokens_per_s"),
                    "baseline_name": "plain Hugging Face: full logits, log_softmax, gather",
                    "limit": f">= {SPEEDUP_TARGET}x",
                    "ratio": ratio(ours.get("tokens_per_s"), base.get("tokens_per_s")),
                }
            )
            if "seconds" in liger:
                rows.append(
                    {
                        "metric": f"{real} tok: tokens/s vs Liger fused linear-CE",
                        "ours": ours.get("tokens_per_s"),
                        "baseline": liger.get("tokens_per_s"),
                        "baseline_name": "Liger's fused linear cross-entropy",
                        "limit": "> baseline (ahead of Liger)",
                        "ratio": ratio(ours.get("tokens_per_s"), liger.get("tokens_per_s")),
                    }
                )
                rows.append(
                    {
                        "metric": f"{real} tok: extra peak GiB vs Liger",
                        "ours": ours.get("extra_peak_gib"),
                        "baseline": liger.get("extra_peak_gib"),
                        "baseline_name": "Liger's fused linear cross-entropy",
                        "limit": "(memory of the field's fused kernel)",
                        "ratio": ratio(ours.get("extra_peak_gib"), liger.get("extra_peak_gib")),
                    }
                )
            rows.append(
                {
                    "metric": f"{real} tok: extra peak GiB",
                    "ours": ours.get("extra_peak_gib"),
                    "baseline": "OOM" if base["oom"] else base.get("extra_peak_gib"),
                    "baseline_name": "plain Hugging Face: full logits, log_softmax, gather",
                    "limit": f"<= {MEMORY_LIMIT:.0%} of baseline",
                    "ratio": ratio(ours.get("extra_peak_gib"), base.get("extra_peak_gib")),
                }
            )
            if tokens == args.tokens[0]:  # entropy and top-k beside the logprobs, one pass
                results[-1]["extras"] = extras_rows(worker, data, real, args.repeats, rows)
    kernels = {}
    if torch.cuda.is_available():
        kernel_table, kernels = kernel_rows(args.tokens[0], vocab, args.repeats)
        rows += kernel_table
        release()
    for label, fn in profiles:
        print(f"== profile: {label}")
        print_profile(fn)
    print_table(
        f"get_logprobs, {num_params / 1e9:.2f}B params, rows of {args.row_len}, "
        f"{args.precision}, fusion={args.fuse}",
        rows,
    )
    write_results(
        "logprobs",
        {
            "num_params": num_params,
            "settings": vars(args),
            "results": results,
            "kernels": kernels,
            "memory_limit_fraction": MEMORY_LIMIT,
            "rows": rows,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
        args.out,
    )


if __name__ == "__main__":
    main()

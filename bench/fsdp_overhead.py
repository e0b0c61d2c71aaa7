"""FSDP2 train-step overhead vs the plain single-process path on one GPU.

Both sides train the same random Qwen2.5-1.5B-shaped model (fp32 master weights, bf16 compute)
on the same batch with the same step: forward, chunked next-token logprobs, mean NLL, backward,
sharding-aware grad norm + clip, AdamW. The plain side is the single-process worker's recipe
(fp32 module under `torch.autocast(bfloat16)`); the FSDP2 side is `parallelize_model` on a
world-of-one process group (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).
Target: FSDP2 within 5 % of plain.

Usage: `python -m bench.fsdp_overhead` (CUDA) or `... --small` (CPU smoke).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import (
    device,
    gib,
    peak_bytes,
    print_table,
    ratio,
    release,
    save_random_model,
    timed,
    write_results,
)
from policyworker.shell.parallel import (
    ParallelContext,
    clip_grads_,
    next_token_logprobs_any,
    parallelize_model,
    total_grad_norm,
)


def load_fp32(path: str) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    return model.to(device())


def make_step(model, ctx, ids, *, autocast: bool, fused: bool):
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **kind)
    amp = (
        torch.autocast(device().type, dtype=torch.bfloat16)
        if autocast
        else contextlib.nullcontext()
    )

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with amp:
            logits = model(input_ids=ids).logits
        loss = -next_token_logprobs_any(logits, ids, ctx).mean()
        loss.backward()
        norm = total_grad_norm(model.parameters(), ctx)
        clip_grads_(model.parameters(), 1.0, norm)
        opt.step()
        return float(loss.detach())

    return step


def measure(name, model, ctx, ids, *, autocast, repeats, fused) -> dict:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    step = make_step(model, ctx, ids, autocast=autocast, fused=fused)
    seconds, loss = timed(step, repeats=repeats, warmup=2)
    tokens = ids.numel()
    result = {
        "name": name,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_gib": gib(peak_bytes()),
        "last_loss": loss,
    }
    print(f"{name}: {seconds * 1e3:.1f} ms/step, {tokens / seconds:,.0f} tok/s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model on CPU (smoke test)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--fused", action="store_true", help="fused AdamW (default foreach)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/)")
    args = parser.parse_args()
    batch = args.batch or (2 if args.small else 4)
    seq = args.seq or (32 if args.small else 2048)
    repeats = args.repeats or (2 if args.small else 10)

    with tempfile.TemporaryDirectory() as tmp:
        num_params = save_random_model(Path(tmp), small=args.small)
        vocab = 1024 if args.small else 151936
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device())

        plain = measure(
            "plain (autocast bf16)",
            load_fp32(tmp),
            ParallelContext.single(device()),
            ids,
            autocast=device().type == "cuda",
            repeats=repeats,
            fused=args.fused,
        )
        release()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"file://{tmp}/rdzv",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            ctx = ParallelContext.from_environment(device=device(), timeout_s=120)
            precision = torch.bfloat16 if device().type == "cuda" else torch.float32
            model = parallelize_model(load_fp32(tmp), ctx, precision=precision)
            fsdp = measure(
                "FSDP2 (world 1, bf16 params)",
                model,
                ctx,
                ids,
                autocast=False,
                repeats=repeats,
                fused=args.fused,
            )
        finally:
            dist.destroy_process_group()

    overhead = fsdp["step_s"] / plain["step_s"] - 1.0
    rows = [
        {
            "metric": "train step ms",
            "ours": fsdp["step_s"] * 1e3,
            "baseline": plain["step_s"] * 1e3,
            "baseline_name": "the plain model in one process, no FSDP",
            "limit": "<= 1.05x",
            "ratio": ratio(fsdp["step_s"], plain["step_s"]),
        },
        {
            "metric": "tokens/s",
            "ours": fsdp["tokens_per_s"],
            "baseline": plain["tokens_per_s"],
            "baseline_name": "the plain model in one process, no FSDP",
            "ratio": ratio(fsdp["tokens_per_s"], plain["tokens_per_s"]),
        },
        {
            "metric": "peak GiB",
            "ours": fsdp["peak_gib"],
            "baseline": plain["peak_gib"],
            "baseline_name": "the plain model in one process, no FSDP",
            "ratio": ratio(fsdp["peak_gib"], plain["peak_gib"]),
        },
    ]
    print_table(
        f"FSDP2 overhead, {num_params / 1e9:.2f}B params, batch {batch} x {seq} "
        f"(ours = FSDP2, baseline = plain single process)",
        rows,
    )
    print(f"overhead: {overhead * 100:+.1f} %")
    payload = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "settings": {**vars(args), "batch": batch, "seq": seq},
        "num_params": num_params,
        "batch": batch,
        "seq": seq,
        "plain": plain,
        "fsdp2": fsdp,
        "overhead_fraction": overhead,
        "rows": rows,
        "torch": torch.__version__,
    }
    write_results("fsdp_overhead", payload, args.out)


if __name__ == "__main__":
    main()

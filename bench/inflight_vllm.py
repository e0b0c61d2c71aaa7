"""In-flight refit into a vLLM ``AsyncLLM`` (the CPU engine here): the longest gap between two
consecutive outputs of a running request per refit, ours (the trainer streams into the worker's
staging while the engine keeps stepping, then one ``collective_rpc`` swaps between two steps:
``VllmInflightRefit``) vs vLLM's own ``pause_generation(mode="keep", clear_cache=False)`` -> the
same stream and swap -> ``resume_generation()``, on the same engine and sender, in the same run.

Each mode runs ``--refits`` refits ``--every`` seconds apart while ``--rows`` greedy requests
decode; the first refit of each mode is a warm-up (its staging files are mapped then) and is not
counted. Throughput: output tokens per second over each mode's window.

    python -m bench.inflight_vllm --small   # the demo's tiny vLLM shape (a minute)
    python -m bench.inflight_vllm           # a ~0.1B shape, fp32 refit of ~0.45 GB
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.common import print_table, write_results
from bench.rows import row
from policyworker.shell.engines import VllmInflightRefit, engine_kwargs
from policyworker.shell.refit import RefitSender
from policyworker.testing import tiny_model

SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=128,
)
MEDIUM = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
)
MAX_LEN = 2048


async def _mode(llm: Any, refit: VllmInflightRefit, mode: str, args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_LEN - 16, detokenize=False, ignore_eos=True
    )
    arrivals: dict[int, list[float]] = {i: [] for i in range(args.rows)}
    stop = asyncio.Event()

    async def decode(i: int) -> None:
        stream = llm.generate({"prompt_token_ids": [2, 5 + i, 9]}, params, f"{mode}-{i}")
        async for _ in stream:
            arrivals[i].append(time.perf_counter())
            if stop.is_set():
                await llm.abort(f"{mode}-{i}")
                return

    tasks = [asyncio.create_task(decode(i)) for i in range(args.rows)]
    while min(len(a) for a in arrivals.values()) < 5:
        await asyncio.sleep(0.01)
    windows, start, swaps, stages = [], time.perf_counter(), [], []
    for _ in range(args.refits):
        await asyncio.sleep(args.every)
        began = time.perf_counter()
        if mode == "pause":
            await llm.pause_generation(mode="keep", clear_cache=False)
        await asyncio.to_thread(refit.stage)
        staged = time.perf_counter()
        reply = await refit.aswap()
        if mode == "pause":
            await llm.resume_generation()
        windows.append((began, time.perf_counter()))
        stages.append(staged - began)
        swaps.append(reply["swapped"]["seconds"] if reply["swapped"] else float("nan"))
    await asyncio.sleep(0.2)  # the step after the last refit
    end = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = []
    for began, done in windows[1:]:  # the longest gap ending between a refit's start and just
        # after its end (the next output after a stall arrives within 0.2 s of it)
        ends = [
            b - a
            for times in arrivals.values()
            for a, b in zip(times, times[1:], strict=False)
            if began < b <= done + 0.2
        ]
        gaps.append(max(ends, default=0.0))
    tokens = sum(sum(1 for t in times if start <= t <= end) for times in arrivals.values())
    return {
        "gaps": gaps,
        "tokens_per_s": tokens / (end - start),
        "swap_s": swaps[1:],
        "stage_s": stages[1:],
    }


async def _bench(llm: Any, trainer: torch.nn.Module, args: argparse.Namespace) -> dict:
    sender = RefitSender(lambda: trainer, torch.float32)
    refit = VllmInflightRefit(llm, sender, timeout_s=120.0, connect=False)
    try:
        await refit.aconnect()
        ours = await _mode(llm, refit, "inflight", args)
        pause = await _mode(llm, refit, "pause", args)
        await refit.aclose()
    finally:
        sender.close()
    return {"ours": ours, "pause": pause}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shape (a smoke run)")
    parser.add_argument("--rows", type=int, default=2, help="requests decoding together")
    parser.add_argument("--refits", type=int, default=4, help="refits per mode (1st: warm-up)")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between refits")
    parser.add_argument("--json", default=None, help="result path")
    args = parser.parse_args()
    if args.refits < 2:
        parser.error("--refits must be >= 2: the first refit of each mode is a warm-up")
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    shape = SMALL if args.small else MEDIUM
    config = dict(shape, max_position_embeddings=MAX_LEN, bos_token_id=2, eos_token_id=1)
    with tempfile.TemporaryDirectory(prefix="bench-inflight-vllm-") as tmp:
        folder = os.path.join(tmp, "model")
        tiny_model("llama", seed=0, dtype=torch.float32, **config).save_pretrained(folder)
        trainer = tiny_model("llama", seed=1, dtype=torch.float32, **config)
        llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=folder,
                dtype="float32",
                enforce_eager=True,
                max_model_len=MAX_LEN,
                skip_tokenizer_init=True,
                seed=0,
                max_num_seqs=max(args.rows, 2),
                **engine_kwargs(),
            )
        )
        try:
            result = asyncio.run(_bench(llm, trainer, args))
        finally:
            llm.shutdown()
    ours, pause = result["ours"], result["pause"]
    name = 'pause_generation(mode="keep") -> same refit -> resume_generation, same engine'
    rows = [
        row(
            "longest output gap per refit, max over refits",
            max(ours["gaps"]) * 1e3,
            unit="ms",
            baseline=max(pause["gaps"]) * 1e3,
            baseline_name=name,
            target="<= 0.1x",
        ),
        row(
            "longest output gap per refit, median over refits",
            statistics.median(ours["gaps"]) * 1e3,
            unit="ms",
            baseline=statistics.median(pause["gaps"]) * 1e3,
            baseline_name=name,
            target="<= 0.1x",
        ),
        row(
            f"output tokens/s with a refit every {args.every:g} s",
            ours["tokens_per_s"],
            unit="tok/s",
            baseline=pause["tokens_per_s"],
            baseline_name=name,
        ),
    ]
    for mode in ("ours", "pause"):  # where a refit's time goes: the stream, then the swap
        stage = statistics.median(result[mode]["stage_s"]) * 1e3
        swap = statistics.median(result[mode]["swap_s"]) * 1e3
        print(f"{mode}: median stage {stage:.1f} ms, median swap {swap:.1f} ms")
    print_table("in-flight refit into AsyncLLM (CPU)", rows)
    write_results(
        "inflight_vllm", {"rows": rows, "settings": vars(args), "device": "cpu"}, args.json
    )


if __name__ == "__main__":
    main()

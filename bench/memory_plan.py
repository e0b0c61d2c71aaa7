"""The memory planner against measured peaks: `PolicyWorker.plan_memory()` per phase beside the
peak the phase reached.

On CUDA, per sequence length (one packed row of that many tokens, `train_mb_tokens` and
`logprob_mb_tokens` equal to it), a random Qwen2.5-shaped model (`--shape 1.5b|7b`, `--lora-dim`
for the 7B on one GPU) runs each phase once to warm up (compile, lazy optimizer state), then
once more after `torch.cuda.reset_peak_memory_stats()`; the measured figure is
`torch.cuda.max_memory_allocated()` of that call (the allocator's peak, not `nvidia-smi`'s,
which adds the CUDA context and the cache). The train call's peak is compared with the larger
of the planned `train_step` and `optimizer_step`. The refit phase needs an engine and is not
measured here. A config the planner refuses at construction is a row saying so.

`--small` runs a tiny shape on the CPU and measures the process's resident memory (sampled every
millisecond, after `malloc_trim`) above its level before each call: a smoke test of the code
path and a loose check only (glibc keeps freed pages, the interpreter and torch allocate beside
the tensors), not the 5 % target.

Usage: ``python -m bench.memory_plan [--shape 1.5b] [--seqs 2048,8192,16384] [--lora-dim 0]
[--optimizer torch.optim.AdamW] [--activation-checkpointing] [--json PATH]``, or ``--small``;
writes
``bench/results/memory_plan.json`` with the row schema of `bench.rows`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import device, make_batch, print_table, release, save_random_model, sync
from bench.common import write_results as write_bench_results
from bench.rows import row
from policyworker import ConfigError, NLLLoss, PolicyWorker

_GIB = 2**30
_PAGE = 4096


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _cpu_peak_extra(fn: Callable[[], Any]) -> int:
    """Resident bytes at the peak of `fn()` above the level before it (1 ms sampling)."""
    with contextlib.suppress(OSError):  # not glibc: measure without trimming
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    before, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join(timeout=10.0)
    return max(peak[0], _rss_bytes()) - before


def _measure(fn: Callable[[], Any], *, cuda: bool) -> int:
    """CUDA: the allocator's peak during `fn()` (absolute); CPU: the RSS rise during it."""
    fn()  # warm-up: compile, the lazy optimizer state
    release()
    if not cuda:
        return _cpu_peak_extra(fn)
    sync()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated()


def _config(model: str, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_name": model,
        "precision": "float32" if args.small else "bfloat16",
        "train_global_batch_size": 1,
        "train_micro_batch_size": 1,
        "logprob_batch_size": 1,
        "max_total_sequence_length": seq,
        "sequence_packing": {"train_mb_tokens": seq, "logprob_mb_tokens": seq},
        "optimizer": {"name": args.optimizer, "kwargs": {"lr": 1e-6}},
        "dtensor_cfg": {"activation_checkpointing": args.activation_checkpointing},
    }
    if args.lora_dim:
        cfg["dtensor_cfg"]["lora_cfg"] = {"dim": args.lora_dim, "match_all_linear": True}
    return cfg


def _phases(worker: PolicyWorker, data: dict, root: Path) -> dict[str, Callable[[], Any]]:
    return {
        "train": lambda: worker.train(data, NLLLoss()),
        "logprobs": lambda: worker.get_logprobs(data),
        "reference": lambda: worker.get_reference_policy_logprobs(data),
        "topk": lambda: worker.get_topk_logits(data, k=8),
        "checkpoint": lambda: worker.save_checkpoint(str(root / "ckpt"), is_final_checkpoint=True),
    }


def _predicted(plan: dict[str, dict[str, Any]], phase: str, *, cuda: bool) -> int:
    """Planned bytes comparable with the measurement: absolute on CUDA; on the CPU the part
    above what is resident before the call (the weights, and after the first train call the
    optimizer state)."""
    if phase == "train":
        total = max(plan["train_step"]["total_bytes"], plan["optimizer_step"]["total_bytes"])
    else:
        total = plan[phase]["total_bytes"]
    if cuda:
        return int(total)
    terms = plan["train_step" if phase == "train" else phase]["terms"]
    resident = terms.get("weights", 0) + terms.get("optimizer_state", 0)
    return int(total - resident)


def run_seq(model: str, seq: int, vocab: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    cuda = not args.small
    data = make_batch([seq], vocab=vocab, seed=seq)
    try:
        worker = PolicyWorker(_config(model, seq, args))
    except ConfigError as exc:
        return [row(f"pre-flight refused, seq {seq}", None, target="", limit=str(exc)[:300])]
    plan = worker.plan_memory()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for phase, fn in _phases(worker, data, Path(tmp)).items():
            measured = _measure(fn, cuda=cuda)
            predicted = _predicted(plan, "train" if phase == "train" else phase, cuda=cuda)
            what = "train (max of train_step, optimizer_step)" if phase == "train" else phase
            out.append(
                row(
                    f"planned / measured peak, {what}, seq {seq}",
                    predicted / _GIB,
                    unit="GiB",
                    baseline=measured / _GIB,
                    baseline_name="torch.cuda.max_memory_allocated"
                    if cuda
                    else "peak RSS rise (CPU, loose)",
                )
            )
            error = abs(predicted / measured - 1) * 100 if measured > 0 else None
            out.append(
                row(
                    f"prediction error, {what}, seq {seq}",
                    error,
                    unit="%",
                    target="<= 5" if cuda else "",
                )
            )
    worker.shutdown()
    del worker
    release()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shape on CPU (smoke test)")
    parser.add_argument("--shape", default="1.5b", choices=["1.5b", "7b"])
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths")
    parser.add_argument("--lora-dim", type=int, default=0)
    parser.add_argument(
        "--optimizer",
        default="torch.optim.AdamW",
        help="the worker's optimizer (dotted class path), e.g. torch.optim.Adafactor for the 7B "
        "shape trained in full on one GPU",
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not args.small and device().type != "cuda":
        parser.error("the GPU comparison needs CUDA; use --small for the CPU smoke run")
    seqs = [
        int(s) for s in (args.seqs or ("256,1024" if args.small else "2048,8192,16384")).split(",")
    ]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(Path(tmp), small=args.small, shape=args.shape)
        import transformers

        vocab = transformers.AutoConfig.from_pretrained(tmp).vocab_size
        for seq in seqs:
            rows += run_seq(tmp, seq, vocab, args)
    print_table("memory plan vs measured peak", rows)
    settings = {**vars(args), "seqs": seqs, "device": str(device())}
    write_bench_results("memory_plan", {"rows": rows, "settings": settings}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

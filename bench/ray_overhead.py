"""Ray worker group overhead: the same calls on a PolicyWorker in this process and on a
one-worker RayWorkerGroup, in the same run, plus the group's start time.

Rows (ours = through the group, baseline = the worker called directly):
- a no-op round trip (`is_alive`): the bare per-call cost of Ray + the group's bookkeeping;
- `get_logprobs` and `train` on the same batch: that cost beside real work (the batch travels
  through Ray's object store both ways, the group shards it and puts the rows back in order);
- the group's start (placement group, actor process, PolicyWorker construction) against the
  direct worker's construction.

One worker on each side, so both run the same kernels on the same device: the difference is
the group. The local Ray cluster is started before any timing (`ray.init` is not counted).

Usage: `python -m bench.ray_overhead` (GPU when present) or `--small` (tiny model on CPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    device,
    make_batch,
    print_table,
    ratio,
    release,
    save_random_model,
    timed,
    write_results,
)


def worker_config(path: str, *, small: bool, rows: int) -> dict:
    return {
        "model_name": path,
        "precision": "float32" if small else "bfloat16",
        "train_global_batch_size": rows,
        "train_micro_batch_size": rows,
        "logprob_batch_size": rows,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6}},
    }


def measure(policy, noop, data, loss_fn, *, repeats: int) -> dict[str, float]:
    """Median seconds of `noop()`, get_logprobs and train on `policy` (worker or group)."""
    noop_s, _ = timed(noop, repeats=repeats * 4, warmup=2)
    logprobs_s, _ = timed(lambda: policy.get_logprobs(data), repeats=repeats, warmup=1)
    train_s, _ = timed(lambda: policy.train(data, loss_fn), repeats=repeats, warmup=1)
    return {"noop_s": noop_s, "get_logprobs_s": logprobs_s, "train_s": train_s}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model on CPU (smoke run)")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", dest="out", default=None, help="JSON path (default results/)")
    args = parser.parse_args()
    rows = args.rows or (4 if args.small else 8)
    seq = args.seq or (32 if args.small else 1024)
    repeats = args.repeats or (5 if args.small else 10)
    torch.set_num_threads(1 if args.small else torch.get_num_threads())

    import ray

    from policyworker import NLLLoss, PolicyWorker
    from policyworker.shell.parallel import ParallelContext
    from policyworker.shell.ray import RayWorkerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            num_params = save_random_model(Path(tmp), small=args.small)
            vocab = 1024 if args.small else 151936
            data = make_batch([seq] * rows, vocab=vocab, seed=0)
            cfg = worker_config(tmp, small=args.small, rows=rows)
            start = time.perf_counter()
            worker = PolicyWorker(cfg, parallel=ParallelContext.single(device()))
            direct_start_s = time.perf_counter() - start
            direct = measure(worker, worker.is_alive, data, NLLLoss(), repeats=repeats)
            worker.shutdown()
            del worker
            release()
            gpus = 1.0 if device().type == "cuda" else 0.0
            with RayWorkerGroup(
                cfg, num_workers=1, gpus_per_worker=gpus, torch_threads=1 if args.small else None
            ) as group:
                group_start_s, phases = group.start_seconds, dict(group.start_phases)
                through_group = measure(
                    group, lambda: group.run("is_alive"), data, NLLLoss(), repeats=repeats
                )
    finally:
        ray.shutdown()

    rows_out = [
        {
            "metric": "no-op call (is_alive) round trip",
            "ours": through_group["noop_s"] * 1e3,
            "baseline": direct["noop_s"] * 1e3,
            "baseline_name": "the worker called in this process",
            "unit": "ms",
        },
        {
            "metric": f"get_logprobs {rows}x{seq}",
            "ours": through_group["get_logprobs_s"] * 1e3,
            "baseline": direct["get_logprobs_s"] * 1e3,
            "baseline_name": "the worker called in this process",
            "unit": "ms",
        },
        {
            "metric": f"train {rows}x{seq} (one step)",
            "ours": through_group["train_s"] * 1e3,
            "baseline": direct["train_s"] * 1e3,
            "baseline_name": "the worker called in this process",
            "unit": "ms",
        },
        {
            "metric": (
                "start: group (1 worker, fresh process) vs PolicyWorker() here (imports done)"
            ),
            "ours": group_start_s,
            "baseline": direct_start_s,
            "baseline_name": "PolicyWorker() in this process",
            "unit": "s",
        },
    ]
    for row in rows_out:
        row["ratio"] = ratio(row["ours"], row["baseline"])
    print_table(
        f"Ray group overhead, {num_params / 1e6:.1f}M params on {device().type} "
        f"(ours = one-worker RayWorkerGroup, baseline = the worker in this process)",
        rows_out,
    )
    print(f"group start phases (s): {phases}")
    write_results(
        "ray_overhead",
        {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "settings": {**vars(args), "batch": [rows, seq]},
            "num_params": num_params,
            "rows": rows_out,
            "batch": [rows, seq],
            "direct": direct,
            "group": through_group,
            "group_start_s": group_start_s,
            "group_start_phases_s": phases,
            "direct_start_s": direct_start_s,
            "ray": ray.__version__,
            "torch": torch.__version__,
        },
        args.out,
    )


if __name__ == "__main__":
    main()

"""Per-refit CPU overhead of the colocated ZMQ refit (the host-side Python, not the copies).

A model with the tensor count and names of Qwen2.5-7B (28 layers, 339 tensors, untied lm_head)
but every dimension divided by 64 (1.9 M parameters), so the copies take well under a
millisecond and what remains is protocol and Python: the parameter walk(s), the bucket plan,
staging allocation and sharing, JSON headers, the receiver's checks and copy launches. fp32
master → bf16 into an ``HFWeightReceiver`` in another process over the shared-memory path (the
CPU twin of CUDA IPC: the same protocol code).

Measured, median of ``--repeats`` (≥ 20) after warm-ups, sender wall time per refit:

- ``ours``: ``stream_weights_via_ipc_zmq`` with a buffer size giving about as many buckets as
  the real 7B model has at its default 1 GiB buffers (15), default mode (staging freed before
  COMPLETE) and ``keep_staging=True``; and at the default (CPU) buffer size: one bucket;
- ``per-tensor`` baseline: one message, one fresh buffer and one round trip per tensor, over the
  same protocol code (as several peers do);
- ``copy ceiling``: cast into staging tensors then into the destinations (two grouped copy
  launches), one process, no protocol: the floor of this model's copies.

Also the sender's parameter walks on their own (metadata walk, live walk, ``state_dict`` alone,
and the plan-cache check: ``state_dict`` + signature compare), so each cost can be traced.

``--stage NAME`` also records the headline numbers under ``stages`` in the JSON (earlier stages
in the file are kept), to compare the code before and after each change. To measure another
copy of ``policyworker`` (e.g. ``git archive <commit> policyworker | tar -x -C DIR``), run from
DIR with this checkout on the path: ``cd DIR && PYTHONPATH=$REPO python -m bench.refit_overhead``
(the folder run from comes first on the path), so versions run back to back under one load.

Usage: ``python -m bench.refit_overhead [--repeats 30] [--stage NAME] [--json PATH]`` (``--small``:
20 repeats, for the bench runner); writes ``bench/results/refit_overhead.json`` with the
``{"rows": [...]}`` schema of the other benches.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import policyworker
from bench.common import REPO, print_table, ratio
from bench.refit_baselines import build_module, per_tensor_stream, state_shapes
from bench.rows import write_result
from policyworker.functional.buckets import align_up
from policyworker.shell.refit import RefitSender, iter_refit_sources, refit_specs, refit_stream

SHAPE = "qwen2.5-7b/64"
TARGET_BUCKETS = 15  # the real 7B shape at the default 1 GiB buffers


def _median_ms(fn: Callable[[], Any], repeats: int, warmup: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), times


def run_receiver(spec_path: str) -> None:
    from policyworker import HFWeightReceiver
    from policyworker.functional.wire.codec import DTYPES_BY_NAME

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    target = build_module(
        {n: tuple(s) for n, s in spec["shapes"].items()},
        dtype=torch.bfloat16,
        device="cpu",
        random=False,
    )
    info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in spec["refit_info"].items()}
    receiver = HFWeightReceiver(target, address=spec["address"], refit_info=info, timeout_s=120)
    print("READY", flush=True)
    cpu_ms = []
    for _ in range(spec["num_refits"]):
        start = time.process_time()
        receiver.receive()
        cpu_ms.append(1e3 * (time.process_time() - start))
    receiver.close()
    print(json.dumps(cpu_ms), flush=True)


def copy_ceiling(
    model: torch.nn.Module, staging: list[torch.Tensor], dest: list[torch.Tensor]
) -> None:
    """Cast every tensor into its staging slot, then into its destination: two grouped launches."""
    sources = list(model.state_dict().values())
    torch._foreach_copy_(staging, sources)
    torch._foreach_copy_(dest, staging)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="sender", choices=["sender", "receiver"])
    parser.add_argument("--spec")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--stage", help="record the headline numbers under this name in the JSON")
    parser.add_argument(
        "--out",
        "--json",
        dest="out",
        default=str(REPO / "bench" / "results" / "refit_overhead.json"),
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="the bench runner's smoke flag: this benchmark is CPU-sized already (20 repeats)",
    )
    args = parser.parse_args()
    if args.role == "receiver":
        run_receiver(args.spec)
        return
    if args.small:
        args.repeats = 20
    if args.repeats < 20:
        parser.error(
            f"--repeats {args.repeats} must be >= 20 (medians of fewer are too noisy here)"
        )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"policyworker from {Path(policyworker.__file__).parent}")
    shapes = state_shapes(SHAPE)
    model = build_module(shapes, dtype=torch.float32, device="cpu", random=True)
    sender = RefitSender(lambda: model, torch.bfloat16)
    info = sender.prepare_refit_info()
    specs = refit_specs(model, torch.bfloat16)
    aligned = sum(align_up(s.nbytes) for s in specs)
    per_buffer = align_up(-(-aligned // TARGET_BUCKETS))
    model_bytes = sum(s.nbytes for s in specs)
    has_keep = "keep_staging" in inspect.signature(sender.stream_weights_via_ipc_zmq).parameters

    configs: list[tuple[str, Callable[[], Any]]] = [
        (
            "ours, ~15 buckets",
            lambda: sender.stream_weights_via_ipc_zmq(2 * per_buffer, timeout_s=60),
        ),
    ]
    if has_keep:
        configs.append(
            (
                "ours, ~15 buckets, keep_staging",
                lambda: sender.stream_weights_via_ipc_zmq(
                    2 * per_buffer, timeout_s=60, keep_staging=True
                ),
            )
        )
    configs += [
        (
            "ours, default buffer (1 bucket)",
            lambda: sender.stream_weights_via_ipc_zmq(timeout_s=60),
        ),
        ("per-tensor", lambda: per_tensor_stream(sender, model, False, 60)),
    ]
    num_refits = len(configs) * (args.repeats + args.warmup) + 1
    wall: dict[str, list[float]] = {name: [] for name, _ in configs}
    cpu: dict[str, list[float]] = {name: [] for name, _ in configs}
    order: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(
            json.dumps(
                {
                    "shapes": shapes,
                    "address": sender.get_zmq_address(),
                    "num_refits": num_refits,
                    "refit_info": {
                        n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()
                    },
                }
            )
        )
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                __spec__.name,
                "--role",
                "receiver",
                "--spec",
                str(spec_path),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "READY"
            buckets = sender.stream_weights_via_ipc_zmq(2 * per_buffer, timeout_s=60)["num_buckets"]
            order.append("first")
            for round_ in range(
                args.warmup + args.repeats
            ):  # interleaved: load drifts hit all alike
                for name, fn in configs:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    fn()
                    if round_ >= args.warmup:
                        wall[name].append(1e3 * (time.perf_counter() - start))
                        cpu[name].append(1e3 * (time.process_time() - start_cpu))
                    order.append(name if round_ >= args.warmup else "warmup")
            receiver_cpu = json.loads(child.stdout.readline())
            assert child.wait(timeout=120) == 0
        finally:
            if child.poll() is None:
                child.kill()
            sender.close()
    results: dict[str, float] = {}
    for name, _ in configs:
        theirs = [ms for ms, who in zip(receiver_cpu, order, strict=True) if who == name]
        results[name] = statistics.median(wall[name])
        results[name + " | sender cpu"] = statistics.median(cpu[name])
        results[name + " | receiver cpu"] = statistics.median(theirs)
        print(
            f"{name:<36} wall {results[name]:8.2f} ms   "
            f"sender cpu {results[name + ' | sender cpu']:8.2f} ms"
            f"   receiver cpu {results[name + ' | receiver cpu']:8.2f} ms",
            flush=True,
        )

    walks = {
        "metadata walk (refit_specs, meta)": lambda: refit_specs(model, torch.bfloat16),
        "live walk (iter_refit_sources)": lambda: list(iter_refit_sources(model, torch.bfloat16)),
        "state_dict(keep_vars=True) alone": lambda: model.state_dict(keep_vars=True),
    }
    # the plan-cache check: state_dict + signature compare, no tensor touched
    walks["refit_stream (state_dict + signature check)"] = lambda: refit_stream(
        model, torch.bfloat16
    )
    for name, fn in walks.items():
        results[name], _ = _median_ms(fn, args.repeats, args.warmup)
    staging = [torch.empty(s, dtype=torch.bfloat16) for s in shapes.values()]
    dest = [torch.empty(s, dtype=torch.bfloat16) for s in shapes.values()]
    results["copy ceiling"], _ = _median_ms(
        lambda: copy_ceiling(model, staging, dest), args.repeats, args.warmup
    )

    rows = [
        {
            "metric": f"refit {what}, {name}",
            "ours": results[name + suffix],
            "baseline": results["per-tensor" + suffix],
            "baseline_name": "per-tensor: one message, buffer and round trip per tensor",
            "limit": results["copy ceiling"] if not suffix else None,
            "ratio": ratio(results[name + suffix], results["per-tensor" + suffix]),
            "unit": "ms",
        }
        for name, _ in configs
        if name != "per-tensor"
        for what, suffix in (
            ("wall ms", ""),
            ("sender cpu ms", " | sender cpu"),
            ("receiver cpu ms", " | receiver cpu"),
        )
    ]
    rows += [
        {
            "metric": f"sender {name}",
            "ours": results[name],
            "baseline": None,
            "limit": None,
            "ratio": None,
            "unit": "ms",
        }
        for name in walks
    ]
    print_table(
        f"refit overhead, {SHAPE}: {len(specs)} tensors, {model_bytes / 1e6:.1f} MB bf16, "
        f"{buckets} buckets of {per_buffer} B (baseline = per-tensor, limit = copy ceiling)",
        rows,
    )

    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    stages = previous.get("stages", {})
    if args.stage:
        stages[args.stage] = {k: round(v, 3) for k, v in results.items()}
    payload = {
        "device": "cpu",
        "shape": SHAPE,
        "num_tensors": len(specs),
        "model_bytes": model_bytes,
        "buffer_bytes": per_buffer,
        "num_buckets": buckets,
        "settings": {"repeats": args.repeats, "warmup": args.warmup, "stage": args.stage},
        "torch": torch.__version__,
        "rows": rows,
        "stages": stages,
    }
    write_result(out, payload)


if __name__ == "__main__":
    main()

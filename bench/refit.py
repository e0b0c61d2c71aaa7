"""Colocated refit benchmark: fp32 master → bf16 into a receiver in another process.

Measured in one run, median of 3 after a warm-up, on Qwen2.5-1.5B- and 7B-shaped random models
(only state-dict shapes matter, so the parameters are built directly, no HF weights):

- ``default``: ``RefitSender.stream_weights_via_ipc_zmq()`` with every option at its default,
  into an ``HFWeightReceiver`` of the module with its defaults: the receiver registers its
  memory, so the default picks the one-pass refit (target: within 1.1x the one-pass ceiling);
- ``staged``: ``stream_weights_via_ipc_zmq(one_pass=False)`` at the default buffer size (staging
  freed before COMPLETE): the two-pass refit a ``load_weights`` receiver (vLLM) gets;
- ``staged-keep``: the same with ``keep_staging=True`` (buffers and the receiver's mappings kept
  between refits: steady-state refits allocate, share and open nothing);
- ``one-pass``: ``stream_weights_via_ipc_zmq(one_pass=True)`` (one-pass insisted on): the sender
  casts straight into the receiver's registered arena (no staging, no copy on the receiver's
  side);
- ``per-tensor``: one IPC handle and one round trip per tensor (as several peers do), over the
  same protocol code;
- ``ceiling``: cast fp32→bf16 into a staging tensor, then staging → destination, back to back in
  one process with no protocol (the two-pass limit of the staged modes);
- ``one-pass-ceiling``: cast fp32→bf16 straight into the destination, in one process with no
  protocol: one read of fp32 and one write of bf16 per parameter, the limit of one-pass. It
  launches its copies as the sender does (``grouped_copy_``: each large tensor alone, the small
  ones in grouped launches);
- ``one-pass-ceiling, alone`` / ``, one group``: the same casts with every tensor in its own
  ``copy_`` / all of them in one ``_foreach_copy_`` call: which launch route the per-tensor
  structure favours. On CUDA each of the three also has ``gpu_span_ms``: first cast start to
  last cast end on the GPU, i.e. the wall time less the host's walk before the first launch;
- ``checkpoint-engine ipc`` / ``collective`` / ``nixl``: the same refit through NeMo-RL's
  checkpoint-engine lifecycle into a ``CheckpointEngineRollout`` (``bench.refit_checkpoint_engine``;
  collective on CPU only: NCCL needs a GPU per rank; nixl where its package imports). Its
  summary rows compare each with our best colocated path (ipc's target: within 10 %) and name
  the mode the engine took (ipc: one-pass into the rollout's registered module, as ``default``);
- ``cast floor``: one ``copy_`` of a single 256 Mi-element fp32 block into bf16, scaled to the
  model's bytes: what the same bytes cost with no per-tensor structure at all.

The ``one-pass`` row also splits each refit's wall time at the sender's write loop
(``phases_ms``): before it (the parameter walk, BEGIN and its ACK), the loop itself (host time to
launch every cast), and after it (COMPLETE until the receiver's reply, which waits for the
casts). An ``after`` well above one round trip means the GPU was still copying when the host
had launched everything; a ``write`` near the total means the host was the limit.

The ``% ceiling`` column compares the ``default`` and ``one-pass*`` rows with
``one-pass-ceiling`` and every other row with ``ceiling``.

Usage: ``python -m bench.refit`` (CUDA) or ``python -m bench.refit --small`` (CPU, seconds).
Prints a table and writes ``bench/results/refit.json``. ``--profile`` also prints the sender's
cProfile of the ``one-pass`` refits (top 25 by own time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from bench.common import REPO
from bench.refit_baselines import (
    REPEATS,
    ROUTE_ROWS,
    SHAPES,
    build_module,
    cast_floor,
    copy_ceiling,
    one_pass_ceiling,
    per_tensor_stream,
    run_receiver,
    state_shapes,
    timed,
)
from bench.refit_checkpoint_engine import ROWS as ENGINE_ROWS
from bench.refit_checkpoint_engine import checkpoint_engine_times, run_ce_receiver
from bench.rows import write_result
from policyworker.functional.buckets import TensorSpec
from policyworker.shell.refit import RefitSender, RefitSource
from policyworker.shell.refit.one_pass import OnePassWriter

# Issue 17's one-pass refit targets (ms), by shape: each one-pass row carries its rule
ONE_PASS_TARGET_MS = {"qwen2.5-1.5b": 5.0, "qwen2.5-7b": 15.0}
# the default refit's target: within this factor of the one-pass copy ceiling
DEFAULT_TARGET_OF_CEILING = 1.1
# rows measured against the one-pass limit (one read + one write per weight)
ONE_PASS_ROWS = ("default", "one-pass")


class PhaseTimedWriter(OnePassWriter):
    """The sender's one-pass writer, noting when each write loop starts and ends."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.loops: list[tuple[float, float]] = []

    def write(
        self,
        specs: Sequence[TensorSpec],
        views: list[torch.Tensor],
        sources: Iterator[RefitSource],
        plain: Sequence[torch.Tensor] | None = None,
        *,
        mirrors: Sequence[list[torch.Tensor]] = (),
    ) -> bytes:
        start = time.perf_counter()
        event = super().write(specs, views, sources, plain, mirrors=mirrors)
        self.loops.append((start, time.perf_counter()))
        return event


def one_pass_phases(sender: RefitSender, cuda: bool) -> tuple[list[float], dict[str, float]]:
    """``timed`` one-pass refits, and the median of each refit's split at the write loop (ms):
    ``before`` it, the loop (``write``) and ``after`` it."""
    writer = PhaseTimedWriter(sender.rank)
    sender._one_pass_writer = writer
    calls: list[tuple[float, float]] = []

    def refit() -> None:
        start = time.perf_counter()
        sender.stream_weights_via_ipc_zmq(timeout_s=300, one_pass=True)
        calls.append((start, time.perf_counter()))

    times = timed(refit, cuda)
    splits = [
        (loop_start - start, loop_end - loop_start, end - loop_end)
        for (start, end), (loop_start, loop_end) in zip(calls[1:], writer.loops[1:], strict=True)
    ]  # the warm-up (the first call) also opens the registration: left out
    phases = {
        name: 1e3 * statistics.median(split[k] for split in splits)
        for k, name in enumerate(("before", "write", "after"))
    }
    return times, phases


def bench_shape(
    name: str, device: str, sweep_gib: list[float] = (), *, profile: bool = False
) -> list[dict]:
    cuda = device.startswith("cuda")
    shapes = state_shapes(name)
    model = build_module(shapes, dtype=torch.float32, device=device, random=True)
    sender = RefitSender(lambda: model, torch.bfloat16, device=device)
    info = sender.prepare_refit_info()
    model_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(
            json.dumps(
                {
                    "device": device,
                    "shapes": shapes,
                    "address": sender.get_zmq_address(),
                    "refit_info": {
                        n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()
                    },
                    "num_refits": (5 + len(sweep_gib)) * (REPEATS + 1),
                }
            )
        )
        child = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--role", "receiver", "--spec", str(spec_path)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "READY"
            default = timed(lambda: sender.stream_weights_via_ipc_zmq(timeout_s=300), cuda)
            staged = timed(
                lambda: sender.stream_weights_via_ipc_zmq(timeout_s=300, one_pass=False), cuda
            )
            per_buffer = sender._plan_key[1]  # the staged plan's per-buffer size
            keep = timed(
                lambda: sender.stream_weights_via_ipc_zmq(
                    timeout_s=300, one_pass=False, keep_staging=True
                ),
                cuda,
            )
            sender.release_staging()
            profiler = cProfile.Profile()
            with profiler if profile else contextlib.nullcontext():
                one_pass, phases = one_pass_phases(sender, cuda)
            if profile:
                print(f"{name}: sender profile of {REPEATS + 1} one-pass refits", flush=True)
                pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
            swept = {}
            for gib in sweep_gib:  # total staging (two buffers), kept between refits
                swept[f"keep {gib:g}GiB"] = timed(
                    lambda gib=gib: sender.stream_weights_via_ipc_zmq(
                        buffer_size_bytes=int(gib * (1 << 30)),
                        timeout_s=300,
                        keep_staging=True,
                        one_pass=False,
                    ),
                    cuda,
                )
                sender.release_staging()
            per_tensor = timed(lambda: per_tensor_stream(sender, model, cuda, 300), cuda)
            child.wait(timeout=300)
            engines, engine_settings = checkpoint_engine_times(
                __spec__.name, sender, shapes, info, device=device, per_buffer=per_buffer
            )
        finally:
            if child.poll() is None:
                child.kill()
            sender.close()
    dest = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    ceiling = timed(lambda: copy_ceiling(model, dest, cuda), cuda)
    spans: dict[str, list[float]] = {}  # GPU spans of the one-pass ceiling per launch route
    routes = {
        ROUTE_ROWS[route]: timed(
            lambda route=route: one_pass_ceiling(
                model, dest, cuda, route, spans.setdefault(route, [])
            ),
            cuda,
        )
        for route in ROUTE_ROWS
    }
    extra: dict[str, dict] = {"one-pass": {"phases_ms": phases}}  # more fields of some rows
    for row, settings in engine_settings.items():
        extra[row] = {"settings": settings}
    for route, route_spans in spans.items():
        if route_spans:  # CUDA only; the warm-up's span left out, as ``timed`` leaves out its time
            extra[ROUTE_ROWS[route]] = {"gpu_span_ms": 1e3 * statistics.median(route_spans[1:])}
    model_elements = sum(t.numel() for t in dest.values())
    floor = cast_floor(model_elements, device, cuda)
    rows = []
    ceiling_s = statistics.median(ceiling)
    measured = {
        "ceiling": ceiling,
        **routes,
        "cast floor": floor,
        "default": default,
        "staged": staged,
        "staged-keep": keep,
        "one-pass": one_pass,
        **swept,
        "per-tensor": per_tensor,
        **engines,
    }
    for method, times in measured.items():
        median = statistics.median(times)
        rows.append(
            {
                "shape": name,
                "method": method,
                "device": device,
                "model_bytes": model_bytes,
                "median_ms": 1e3 * median,
                "gb_per_s": model_bytes / median / 1e9,
                # one-pass rows against their own limit (one read + one write), others two-pass
                "fraction_of_ceiling": (
                    statistics.median(routes["one-pass-ceiling"])
                    if method.startswith(ONE_PASS_ROWS)
                    or method == "cast floor"
                    or engine_settings.get(method, {}).get("mode") == "one-pass"
                    else ceiling_s
                )
                / median,
                "times_ms": [1e3 * t for t in times],
                **extra.get(method, {}),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--small", action="store_true", help="tiny shape on CPU (a smoke test in seconds)"
    )
    parser.add_argument("--role", default="sender", choices=["sender", "receiver", "ce-receiver"])
    parser.add_argument("--spec")
    parser.add_argument(
        "--sweep-gib",
        type=float,
        nargs="*",
        default=[],
        help="also time kept staging of these total sizes (GiB, two buffers)",
    )
    parser.add_argument(
        "--shapes", nargs="*", choices=sorted(SHAPES), help="measure only these shapes"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print the sender's cProfile of the one-pass refits (top 25 by own time)",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "refit.json"))
    args = parser.parse_args()
    if args.role == "receiver":
        run_receiver(args)
        return
    if args.role == "ce-receiver":
        run_ce_receiver(args)
        return
    if args.small:
        device, names = "cpu", ["tiny"]
    else:
        if not torch.cuda.is_available():
            parser.error("CUDA is needed for the full benchmark; use --small on CPU")
        device, names = "cuda", ["qwen2.5-1.5b", "qwen2.5-7b"]
    if args.shapes:
        names = args.shapes
    header = f"{'shape':<16}{'method':<28}{'GB (bf16)':>10}{'median ms':>11}{'GB/s':>9}"
    print(header + f"{'% ceiling':>11}", flush=True)
    rows = []
    for name in names:  # each shape's rows as soon as they are measured
        rows.extend(shape_rows := bench_shape(name, device, args.sweep_gib, profile=args.profile))
        for r in shape_rows:
            print(
                f"{r['shape']:<16}{r['method']:<28}"
                f"{r['model_bytes'] / 1e9:>10.3f}{r['median_ms']:>11.2f}"
                f"{r['gb_per_s']:>9.1f}{100 * r['fraction_of_ceiling']:>10.0f}%",
                flush=True,
            )
            if "phases_ms" in r:
                split = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items())
                print(f"{'':<16}{'  ms per phase:':<28}{split}", flush=True)
            if "settings" in r:
                print(f"{'':<16}{'  mode:':<28}{r['settings']['mode']}", flush=True)
            if "gpu_span_ms" in r:
                print(f"{'':<16}{'  GPU span ms:':<28}{r['gpu_span_ms']:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        out,
        {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "repeats": REPEATS,
            "settings": {
                "shapes": names,
                "repeats": REPEATS,
                "sweep_gib": args.sweep_gib,
                "profile": args.profile,
            },
            "rows": summary_rows(rows),
            "measurements": rows,
        },
    )


def summary_rows(measurements: list[dict]) -> list[dict]:
    """The shared bench schema: per shape, ours beside the per-tensor baseline and the ceiling."""
    by_key = {(m["shape"], m["method"]): m for m in measurements}
    rows = []
    for shape in dict.fromkeys(m["shape"] for m in measurements):
        ceiling, baseline = by_key[(shape, "ceiling")], by_key[(shape, "per-tensor")]
        for method in ("default", "staged", "staged-keep", "one-pass"):
            ours = by_key.get((shape, method))
            if ours is None:
                continue
            if method == "one-pass":  # against its own limit: one read + one write per weight
                limit = by_key[(shape, "one-pass-ceiling")]["median_ms"]
                rows.append(
                    {
                        "metric": f"{shape} one-pass copy ceiling ms, grouped launches "
                        "(baseline = one copy_ per tensor; limit = cast floor)",
                        "ours": limit,
                        "baseline": by_key[(shape, "one-pass-ceiling, alone")]["median_ms"],
                        "baseline_name": "one copy_ per tensor",
                        "limit": by_key[(shape, "cast floor")]["median_ms"],
                        "unit": "ms",
                    }
                )
                target = ONE_PASS_TARGET_MS.get(shape)
                rows.append(
                    {
                        "metric": f"{shape} one-pass refit ms (limit = one-pass copy ceiling)",
                        "ours": ours["median_ms"],
                        "baseline": by_key[(shape, "staged")]["median_ms"],
                        "baseline_name": "the staged refit (two passes)",
                        "limit": limit,
                        "unit": "ms",
                        **({} if target is None else {"target": f"<= {target:g}"}),
                    }
                )
                continue
            if method == "default":  # both sides' defaults: one-pass into a module receiver
                limit = by_key[(shape, "one-pass-ceiling")]["median_ms"]
                rows.append(
                    {
                        "metric": f"{shape} default refit ms (limit = one-pass copy ceiling)",
                        "ours": ours["median_ms"],
                        "baseline": by_key[(shape, "staged")]["median_ms"],
                        "baseline_name": "the staged refit (one_pass=False, two passes)",
                        "limit": limit,
                        "unit": "ms",
                        "target": f"<= {DEFAULT_TARGET_OF_CEILING * limit:.2f} "
                        f"({DEFAULT_TARGET_OF_CEILING:g}x the one-pass ceiling)",
                    }
                )
                rows.append(
                    {
                        "metric": f"{shape} default refit / one-pass copy ceiling",
                        "ours": ours["median_ms"] / limit,
                        "limit": 1.0,
                        "unit": "x",
                        "target": f"<= {DEFAULT_TARGET_OF_CEILING:g}",
                    }
                )
                continue
            rows.append(
                {
                    "metric": f"{shape} {method} refit ms (limit = copy ceiling)",
                    "ours": ours["median_ms"],
                    "baseline": baseline["median_ms"],
                    "baseline_name": "per-tensor: one message, buffer and round trip per tensor",
                    "limit": ceiling["median_ms"],
                    "unit": "ms",
                }
            )
            rows.append(
                {
                    "metric": f"{shape} {method} fraction of the copy ceiling",
                    "ours": ours["fraction_of_ceiling"],
                    "limit": 0.8,
                    "unit": "",
                }
            )
        best = min(
            (
                by_key[(shape, m)]
                for m in ("default", "staged", "staged-keep", "one-pass")
                if (shape, m) in by_key
            ),
            key=lambda m: m["median_ms"],
        )
        for method in ENGINE_ROWS.values():
            engine = by_key.get((shape, method))
            if engine is not None:
                mode = engine.get("settings", {}).get("mode")
                one_pass = mode == "one-pass"  # its limit: one read + one write per weight
                rows.append(
                    {
                        "metric": f"{shape} {method}{f' ({mode})' if mode else ''} refit ms "
                        f"(baseline = our best colocated path, {best['method']}; limit = "
                        f"{'one-pass ' if one_pass else ''}copy ceiling)",
                        "ours": engine["median_ms"],
                        "baseline": best["median_ms"],
                        "baseline_name": f"our best colocated path ({best['method']})",
                        "limit": by_key[(shape, "one-pass-ceiling")]["median_ms"]
                        if one_pass
                        else ceiling["median_ms"],
                        "unit": "ms",
                        **(
                            {"target": "<= 1.10 x baseline"} if method == ENGINE_ROWS["ipc"] else {}
                        ),
                    }
                )
    return rows


if __name__ == "__main__":
    main()

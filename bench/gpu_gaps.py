"""Where the GPU waits: idle gaps of a torch.profiler chrome trace, each blamed on the host op
that launched the kernel ending it.

Used by `bench.train_step --profile` and `bench.logprobs --profile` (a helper with no main
guard, so `policyworker bench` does not run it as a benchmark).
The GPU's busy time is the union of its kernel/memcpy/memset intervals (all streams); a gap is
a stretch inside the profiled span where none runs. The kernel after a gap was launched by a
runtime call (matched by correlation id) inside some host ops: the gap's time is added to the
outermost and innermost of those ops, so a gap after a host sync (`aten::item`,
`aten::_local_scalar_dense`, a DtoH copy) or behind slow launches (a compiled graph's
wrapper) shows which. Host synchronizations (runtime calls named *Synchronize*) are summed.
When the trace holds the `CALL_ANNOTATION` range (`print_profile` wraps its call in one), the
host time of the call outside the device span is reported too: before the first device op
(with the top-level host ops that ran then) and after the last one. A call's wall time minus
its device span is that host time.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
CALL_ANNOTATION = "profiled call"


def _busy_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def gap_report(events: list[dict[str, Any]], *, min_gap_us: float = 20.0, top: int = 12) -> str:
    """A text report of device idle time in `events` (a chrome trace's traceEvents)."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATEGORIES]
    if not device:
        return "gpu gaps: no device events in the trace"
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in _RUNTIME_CATEGORIES and "correlation" in e.get("args", {})
    }
    host_ops: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            host_ops[e.get("tid")].append(e)
    for ops in host_ops.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in host_ops.items()}
    busy = _busy_union([(e["ts"], e["ts"] + e["dur"]) for e in device])
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    by_start = sorted(device, key=lambda e: e["ts"])
    kernel_starts = [e["ts"] for e in by_start]
    outer: dict[str, float] = defaultdict(float)
    inner: dict[str, float] = defaultdict(float)
    gaps = 0
    for (_, prev_end), (next_start, _) in zip(busy, busy[1:], strict=False):
        gap = next_start - prev_end
        if gap < min_gap_us:
            continue
        gaps += 1
        first = by_start[bisect.bisect_left(kernel_starts, next_start)]
        launch = runtime.get(first.get("args", {}).get("correlation"))
        if launch is None:
            outer["(launch not traced)"] += gap
            continue
        tid, ts = launch.get("tid"), launch["ts"]
        before = host_ops.get(tid, [])[: bisect.bisect_right(starts.get(tid, []), ts)]
        enclosing = [e for e in before if e["ts"] + e["dur"] >= ts]
        outer[enclosing[0]["name"] if enclosing else "(no host op)"] += gap
        inner[enclosing[-1]["name"] if enclosing else launch["name"]] += gap
    syncs = [e for e in runtime.values() if "Synchronize" in e.get("name", "")]
    lines = [
        f"gpu gaps: span {span / 1e3:.1f} ms, busy {busy_us / 1e3:.1f} ms "
        f"({100 * busy_us / span:.1f} %), idle {(span - busy_us) / 1e3:.1f} ms in {gaps} gaps "
        f">= {min_gap_us:.0f} us; host syncs: {len(syncs)} calls, "
        f"{sum(e['dur'] for e in syncs) / 1e3:.1f} ms",
        "idle ms by the outermost host op launching the kernel after the gap:",
    ]
    lines += [f"  {ms / 1e3:9.2f}  {name[:90]}" for name, ms in _top(outer, top)]
    lines.append("idle ms by the innermost host op launching it:")
    lines += [f"  {ms / 1e3:9.2f}  {name[:90]}" for name, ms in _top(inner, top)]
    call = next((e for ops in host_ops.values() for e in ops if e["name"] == CALL_ANNOTATION), None)
    if call is not None:
        lines += _outside_the_device_span(call, host_ops.get(call.get("tid"), []), busy, top)
    return "\n".join(lines)


def _outside_the_device_span(
    call: dict[str, Any],
    ops: list[dict[str, Any]],
    busy: list[tuple[float, float]],
    top: int,
) -> list[str]:
    """The call's host time before its first device op and after its last, and the top-level
    host ops (on the call's thread, inside the call) that ran before the first one, in ms up to
    that op's start."""
    start, end = call["ts"], call["ts"] + call["dur"]
    first, last = busy[0][0], busy[-1][1]
    lead: dict[str, float] = defaultdict(float)
    covered_until = start
    for op in ops:  # sorted by start: an op starting inside the previous top-level one is nested
        if op is call or op["ts"] < covered_until or not start <= op["ts"] < first:
            continue
        lead[op["name"]] += min(op["ts"] + op["dur"], first) - op["ts"]
        covered_until = op["ts"] + op["dur"]
    lead["(in no host op: Python)"] = max(first - start, 0.0) - sum(lead.values())
    lines = [
        f"call {call['dur'] / 1e3:.2f} ms: host before the first device op "
        f"{max(first - start, 0.0) / 1e3:.2f} ms, after the last "
        f"{max(end - last, 0.0) / 1e3:.2f} ms",
        "host ms before the first device op, by top-level host op:",
    ]
    lines += [f"  {ms / 1e3:9.2f}  {name[:90]}" for name, ms in _top(lead, top)]
    return lines


def _top(totals: dict[str, float], n: int) -> list[tuple[str, float]]:
    return sorted(totals.items(), key=lambda kv: -kv[1])[:n]


def trace_gap_report(path: str | Path, **kwargs: Any) -> str:
    """`gap_report` of a chrome trace file (`prof.export_chrome_trace(path)`)."""
    body = json.loads(Path(path).read_text())
    return gap_report(body.get("traceEvents", body), **kwargs)


def print_profile(fn: Callable[[], Any], *, rows: int = 30, shape_rows: int = 40) -> None:
    """Run `fn` once under torch.profiler and print where its device time goes: the GPU gaps
    (`gap_report`), the top ops, and the top ops by input shape (so a cast of weights can be
    told from a cast of activations). Time nothing after it in the same process but what the
    profiler leaves behind (`common.timed` refuses otherwise; see `common.mark_profiled`)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.common import mark_profiled

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    mark_profiled()
    with (
        profile(activities=activities, record_shapes=True) as prof,
        torch.profiler.record_function(CALL_ANNOTATION),
    ):
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        print(trace_gap_report(trace))
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by=key, row_limit=shape_rows, max_name_column_width=40, max_shapes_column_width=80
        )
    )


def print_call_profile(fn: Callable[[], Any]) -> None:
    """`print_profile` of one call of `fn`, then dynamo's counters (graph breaks and recompiles
    show a compiled layer that fell back to eager), then where a further call spends host time
    (cProfile, top 30 by own time: what launching the kernels costs)."""
    import cProfile
    import pstats

    from torch._dynamo.utils import counters

    print_profile(fn)
    for section in ("graph_break", "recompiles", "stats", "frames"):
        if counters.get(section):
            print(f"dynamo {section}: {dict(counters[section])}")
    host = cProfile.Profile()
    host.runcall(fn)
    print("host time of one more call (cProfile, top 30 by own time):")
    pstats.Stats(host).sort_stats("tottime").print_stats(30)

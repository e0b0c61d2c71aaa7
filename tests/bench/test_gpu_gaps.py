"""bench/gpu_gaps.py: idle time of a synthetic chrome trace, blamed on the launching host ops."""

import pytest

from bench import common, gpu_gaps


def _op(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": {}}


def _kernel(ts, dur, correlation, stream=7):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": "k",
        "ts": ts,
        "dur": dur,
        "tid": stream,
        "args": {"correlation": correlation},
    }


def _launch(ts, correlation):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 2,
        "tid": 1,
        "args": {"correlation": correlation},
    }


def test_gaps_are_summed_and_blamed_on_the_ops_that_launched_the_next_kernel():
    events = [
        _op("train", 0, 1000),
        _op("aten::item", 100, 250),  # a host sync: the GPU drains, then waits for launches
        _op("CompiledFunction", 400, 300),
        _launch(410, 2),
        _op("aten::mm", 800, 50),
        _launch(805, 3),
        _kernel(0, 100, 1),
        _kernel(90, 60, 9, stream=8),  # overlaps on another stream: one busy interval
        _kernel(450, 100, 2),  # 300 us idle before it, launched inside CompiledFunction
        _kernel(560, 40, 4),  # a 10 us gap: below the threshold
        _kernel(810, 10, 3),  # 210 us idle, launched inside aten::mm
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaStreamSynchronize",
            "ts": 120,
            "dur": 30,
            "tid": 1,
            "args": {"correlation": 99},
        },
    ]
    report = gpu_gaps.gap_report(events, min_gap_us=20)
    lines = report.splitlines()
    assert "span 0.8 ms, busy 0.3 ms (36.6 %), idle 0.5 ms in 2 gaps" in lines[0]
    assert "host syncs: 1 calls, 0.0 ms" in lines[0]
    outer = lines[
        lines.index("idle ms by the outermost host op launching the kernel after the gap:") + 1
    ]
    assert outer.split() == ["0.51", "train"]
    inner = lines[lines.index("idle ms by the innermost host op launching it:") + 1 :]
    assert [line.split() for line in inner] == [["0.30", "CompiledFunction"], ["0.21", "aten::mm"]]


def test_a_trace_without_device_events_says_so():
    assert gpu_gaps.gap_report([_op("x", 0, 1)]) == "gpu gaps: no device events in the trace"


def test_a_profiled_call_splits_its_host_time_outside_the_device_span():
    """With the call's annotation in the trace: host time before the first device op (by
    top-level host op, nested ones folded in, the rest in Python) and after the last one."""
    annotation = _op(gpu_gaps.CALL_ANNOTATION, 0, 1000, cat="user_annotation")
    events = [
        annotation,
        _op("validate", 50, 100),
        _op("aten::max", 60, 20),  # nested inside validate
        _op("aten::embedding", 280, 200),  # overlaps the first kernel: counted up to its start
        _launch(310, 1),
        _kernel(400, 300, 1),
        _op("aten::cat", 750, 10),  # after the first kernel: not part of the lead-in
    ]
    lines = gpu_gaps.gap_report(events).splitlines()
    at = lines.index("host ms before the first device op, by top-level host op:")
    assert lines[at - 1] == (
        "call 1.00 ms: host before the first device op 0.40 ms, after the last 0.30 ms"
    )
    assert [line.split(maxsplit=1) for line in lines[at + 1 :]] == [
        ["0.18", "(in no host op: Python)"],
        ["0.12", "aten::embedding"],
        ["0.10", "validate"],
    ]


def test_a_bench_cannot_time_a_row_after_a_profile_in_its_process(monkeypatch, capsys):
    """torch.profiler leaves CUPTI attached, so a row timed after a profile would measure a
    slower process: `timed` refuses it unless the caller measures exactly that slowdown."""
    monkeypatch.setattr(common, "_profile_ran", False)
    calls = []
    seconds, result = common.timed(lambda: calls.append(1) or len(calls), repeats=2)
    assert seconds >= 0 and result == 3  # one warm-up call, then two timed ones
    gpu_gaps.print_profile(lambda: sum(range(10)))
    assert "gpu gaps: no device events in the trace" in capsys.readouterr().out  # CPU profile
    with pytest.raises(RuntimeError, match="after torch.profiler ran in this process"):
        common.timed(lambda: None, repeats=1)
    _, result = common.timed(lambda: 7, repeats=1, warmup=0, after_profile=True)
    assert result == 7

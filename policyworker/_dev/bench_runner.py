"""`policyworker bench`: run the scripts in `bench/`, gather their JSON, print one table.

Each `bench/<name>.py` is run as `python bench/<name>.py [--small] --json bench/results/<name>.json`
(`--json` only when the script's source declares that option; otherwise the script must write
that file itself). Helpers without a `__main__` guard (`bench/common.py`) are not run. The
agreed result schema is::

    {"rows": [{"metric": str, "ours": float, "baseline": float | null,
               "limit": float | str | null, "ratio": float | null, "unit": str,
               "target": str}, ...], ...anything else...}

`ratio` defaults to ours / baseline. A row's target is a rule as text (see `row_verdict`):
its `target`, or a `limit` given as text. Results written before this schema existed are normalized
by a small per-benchmark adapter (`ADAPTERS`), or else every numeric leaf becomes a row of its
own. The runner writes `bench/results/summary.json` (date, host, torch, every row, exit codes)
and exits non-zero if any script failed.

`--report DIR` reads results already written (a GPU run's folder copied back) instead of running:
the same table, each file's settings and the targets' verdicts (`report`).

Why it is over 400 lines: besides the runner it holds the per-benchmark adapters for results
written before the schema (``ADAPTERS``), the table formatting and the report of a folder; each
piece is short, and they are one command's code.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import asdict, frozen

__all__ = [
    "ADAPTERS",
    "BenchRow",
    "RunResults",
    "default_bench_dir",
    "discover",
    "format_table",
    "main",
    "meaningless_on_cpu",
    "normalize_rows",
    "read_results",
    "report",
    "row_verdict",
    "run_benchmarks",
]


@frozen(kw_only=True)
class BenchRow:
    """One line of the table: our figure, the baseline's, the limit, ours / baseline."""

    bench: str
    metric: str
    ours: float | None
    baseline: float | None = None
    limit: float | None = None
    ratio: float | None = None
    unit: str = ""
    target: str = ""  # a rule as text ("<= 1.05x", ">= baseline", ">= 0.4"); judged by row_verdict


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _ratio(ours: float | None, baseline: float | None) -> float | None:
    if ours is None or baseline is None or baseline == 0:
        return None
    return ours / baseline


def _row(bench: str, raw: Mapping[str, Any]) -> BenchRow:
    ours, baseline = _num(raw.get("ours")), _num(raw.get("baseline"))
    ratio, limit = _num(raw.get("ratio")), raw.get("limit")
    return BenchRow(
        bench=bench,
        metric=str(raw.get("metric", "?")),
        ours=ours,
        baseline=baseline,
        limit=_num(limit),
        ratio=ratio if ratio is not None else _ratio(ours, baseline),
        unit=str(raw.get("unit", "")),
        target=next((t for t in (raw.get("target"), limit) if isinstance(t, str)), ""),
    )


def _lora_rows(bench: str, r: Mapping[str, Any]) -> list[BenchRow]:
    """bench/lora.py's own layout: LoRA vs full fine-tuning tokens/s, merge cost at refit."""
    lora_tps, full_tps = r["lora"]["tokens_per_s"], r["full_ft"]["tokens_per_s"]
    merged, cast = r["lora_refit_s"] * 1e3, r["lora_refit_no_merge_s"] * 1e3
    default = r.get("lora_bf16_adapters", {}).get("tokens_per_s")  # compute_dtype: auto
    rows = [] if default is None else [
        BenchRow(
            bench=bench,
            metric="train tokens/s, LoRA (default compute_dtype) vs full fine-tuning",
            ours=default,
            baseline=full_tps,
            ratio=_ratio(default, full_tps),
            unit="tok/s",
            target=">= 1.1x (issue 17)",
        )
    ]  # fmt: skip
    return [
        *rows,
        BenchRow(
            bench=bench,
            metric="train tokens/s, LoRA (fp32 adapters) vs full fine-tuning",
            ours=lora_tps,
            baseline=full_tps,
            ratio=_ratio(lora_tps, full_tps),
            unit="tok/s",
        ),
        BenchRow(
            bench=bench,
            metric="refit tensors, LoRA merge+cast vs cast only",
            ours=merged,
            baseline=cast,
            ratio=_ratio(merged, cast),
            unit="ms",
        ),
        *_compiled_merge_rows(bench, r.get("compiled_merge")),
    ]


def _compiled_merge_rows(bench: str, merge: Mapping[str, Any] | None) -> list[BenchRow]:
    """The compiled merge-kernel row (CUDA runs since 8a1796c; absent elsewhere)."""
    if merge is None:
        return []
    return [
        BenchRow(
            bench=bench,
            metric=f"compiled LoRA merge + cast {merge['shape']}, GEMM vs reduction (before)",
            ours=merge["gemm_us"],
            baseline=merge["reduction_us"],
            limit=merge["limit_us"],
            ratio=_ratio(merge["gemm_us"], merge["reduction_us"]),
            unit="us",
        )
    ]


def _checkpoint_rows(bench: str, r: Mapping[str, Any]) -> list[BenchRow]:
    """bench/checkpoint.py's own layout: save/load throughput against the raw disk (one stream
    as the baseline; as many streams as the writer threads, when reported, as the limit)."""
    disk = r["raw_write_GBps"]
    sync_saves = [("sync save vs raw disk write", r["sync_save_GBps"])]
    if "sync_save_staged_GBps" in r:  # results from before 54311ca have no such save
        sync_saves.append(
            (
                "sync save after an async one (staging kept) vs raw disk write",
                r["sync_save_staged_GBps"],
            )
        )
    rows = [
        *(
            BenchRow(
                bench=bench,
                metric=metric,
                ours=gbps,
                baseline=disk,
                limit=r.get("raw_write_parallel_GBps", disk),
                ratio=_ratio(gbps, disk),
                unit="GB/s",
                target=">= 80% of baseline (issue 17)",
            )
            for metric, gbps in sync_saves
        ),
        BenchRow(
            bench=bench,
            metric="async save: time training is blocked vs sync save",
            ours=r["async_blocked_s"],
            baseline=r["sync_save_s"],
            ratio=_ratio(r["async_blocked_s"], r["sync_save_s"]),
            unit="s",
            target="<= 10% of baseline (issue 17)",
        ),
    ]
    if "sync_save_optimizer_dcp_copies_only_s" in r:  # results since the DCP save planner
        ours_s, dcp_s = r["sync_save_optimizer_only_s"], r["sync_save_optimizer_dcp_copies_only_s"]
        rows.append(
            BenchRow(
                bench=bench,
                metric="sync save of the optimizer alone: bounce buffers vs DCP's own .cpu()",
                ours=r["sync_save_optimizer_only_bytes"] / 1e9 / ours_s,
                baseline=r["sync_save_optimizer_dcp_copies_only_bytes"] / 1e9 / dcp_s,
                limit=r.get("raw_write_parallel_GBps", disk),
                ratio=_ratio(dcp_s, ours_s),
                unit="GB/s",
            )
        )
    if "load_GBps" in r:  # absent with --skip-load
        rows += [
            BenchRow(
                bench=bench,
                metric="load (cold page cache) vs raw disk read",
                ours=r["load_GBps"],
                baseline=r["raw_read_GBps"],
                limit=r.get("raw_read_parallel_GBps", r["raw_read_GBps"]),
                ratio=_ratio(r["load_GBps"], r["raw_read_GBps"]),
                unit="GB/s",
                target=">= 80% of baseline (issue 17)",
            ),
            BenchRow(
                bench=bench, metric="load bit-exact (1 = yes)", ours=float(bool(r["load_exact"]))
            ),
        ]
    return rows


ADAPTERS: dict[str, Callable[[str, Mapping[str, Any]], list[BenchRow]]] = {
    "checkpoint": _checkpoint_rows,
    "lora": _lora_rows,
}


def _leaves(prefix: str, value: Any) -> list[tuple[str, float]]:
    if isinstance(value, Mapping):
        out: list[tuple[str, float]] = []
        for key, sub in value.items():
            out += _leaves(f"{prefix}.{key}" if prefix else str(key), sub)
        return out
    number = _num(value)
    return [(prefix, number)] if number is not None and math.isfinite(number) else []


def normalize_rows(bench: str, result: Any) -> list[BenchRow]:
    """Rows of one benchmark's JSON: the agreed schema, an adapter, or every numeric leaf."""
    if isinstance(result, Mapping) and isinstance(result.get("rows"), list):
        return [_row(bench, raw) for raw in result["rows"]]
    if isinstance(result, list) and all(isinstance(r, Mapping) for r in result):
        return [_row(bench, raw) for raw in result]
    if bench in ADAPTERS and isinstance(result, Mapping):
        try:
            return ADAPTERS[bench](bench, result)
        except (KeyError, TypeError):
            pass  # an older/newer layout: fall back to the generic rows below
    return [BenchRow(bench=bench, metric=name, ours=value) for name, value in _leaves("", result)]


_RULE = re.compile(r"(<=|>=|<|>)\s*(baseline|[0-9]*\.?[0-9]+)\s*(x|%)?\s*(of baseline)?")
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
}
# Figures that mean nothing on a CPU run: MFU is against the GPU's bf16 peak, and peak GiB is
# CUDA memory (0 without CUDA).
_GPU_ONLY = re.compile(r"\bMFU\b|peak GiB|GiB peak|^peak GiB$", re.IGNORECASE)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def meaningless_on_cpu(row: BenchRow) -> bool:
    """True for a figure that only means something on a GPU (MFU, CUDA peak memory)."""
    return any(_GPU_ONLY.search(text) for text in (row.metric, row.unit, row.target))


def row_verdict(row: BenchRow) -> str | None:
    """'pass' / 'fail' against the row's text target, 'n/a' when a needed figure is missing or
    not finite, None when the row has no target the runner can read.

    Rules: "<= 1.05x" compares the ratio; "<= 80% of baseline" the ratio with 0.8; ">= baseline"
    ours with the baseline; ">= 0.4" or "(< 139)" ours with the number.
    """
    match = _RULE.search(row.target)
    if match is None:
        return None
    op, bound_text, suffix, of_baseline = match.groups()
    if bound_text == "baseline":
        value, bound = row.ours, row.baseline
    elif suffix == "x" or suffix == "%" or of_baseline:
        value = row.ratio
        bound = float(bound_text) / (100.0 if suffix == "%" else 1.0)
    else:
        value, bound = row.ours, float(bound_text)
    if not (_finite(value) and _finite(bound)):
        return "n/a"
    assert value is not None and bound is not None
    return "pass" if _COMPARE[op](value, bound) else "fail"


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "n/a"
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:.3e}"


def format_table(rows: Sequence[BenchRow], *, cpu: bool = False) -> str:
    """A fixed-width table: bench, metric, ours, baseline, limit (number or rule), ratio, unit,
    check (pass / FAIL / n/a). With ``cpu``, GPU-only figures (``meaningless_on_cpu``) are n/a."""
    header = ("bench", "metric", "ours", "baseline", "limit", "ratio", "unit", "check")
    body = []
    for r in rows:
        if cpu and meaningless_on_cpu(r):
            body.append(
                (r.bench, r.metric, "n/a", "n/a", r.target or _fmt(r.limit), "n/a", r.unit, "n/a")
            )
            continue
        ratio = (
            "-" if r.ratio is None else ("n/a" if not math.isfinite(r.ratio) else f"{r.ratio:.2f}x")
        )
        verdict = row_verdict(r)
        body.append(
            (
                r.bench,
                r.metric,
                _fmt(r.ours),
                _fmt(r.baseline),
                r.target or _fmt(r.limit),
                ratio,
                r.unit,
                "-" if verdict is None else verdict.replace("fail", "FAIL"),
            )
        )
    widths = [max(len(str(line[i])) for line in (header, *body)) for i in range(len(header))]
    lines = []
    for j, line in enumerate((header, *body)):
        cells = [
            str(c).ljust(w) if i < 2 or i >= 6 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def default_bench_dir() -> Path:
    """`bench/` beside the installed package (the repository checkout), or `./bench`."""
    beside = Path(__file__).resolve().parents[2] / "bench"
    return beside if beside.is_dir() else Path.cwd() / "bench"


def discover(bench_dir: Path, only: Sequence[str] = ()) -> list[Path]:
    """The benchmark scripts, sorted: `*.py` with a `__main__` guard, not `_*.py` (helpers such
    as `common.py` have no guard); `only` picks names (no `.py`).

    Raises:
        ValueError: a name in `only` has no script.
    """
    scripts = sorted(
        p
        for p in bench_dir.glob("*.py")
        if not p.name.startswith("_") and "__main__" in p.read_text()
    )
    if not only:
        return scripts
    by_name = {p.stem: p for p in scripts}
    missing = [n for n in only if n not in by_name]
    if missing:
        msg = (
            f"--only {', '.join(missing)}: no such benchmark in {bench_dir}; available: "
            f"{', '.join(by_name) or 'none'}"
        )
        raise ValueError(msg)
    return [by_name[n] for n in only]


def _hardware() -> str:
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)}x {names[0]}"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_benchmarks(
    bench_dir: Path, *, small: bool, only: Sequence[str] = (), timeout_s: float = 3600.0, out=None
) -> tuple[list[BenchRow], dict[str, Any]]:
    """Run each script, read its JSON; return (all rows, the summary written to summary.json)."""
    out = out or sys.stdout
    results_dir = bench_dir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    root = bench_dir.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    rows: list[BenchRow] = []
    runs: dict[str, Any] = {}
    for script in discover(bench_dir, only):
        name, json_path = script.stem, results_dir / f"{script.stem}.json"
        cmd = [sys.executable, str(script)] + (["--small"] if small else [])
        if '"--json"' in script.read_text():
            cmd += ["--json", str(json_path)]
        log_path = results_dir / f"{name}.log"
        out.write(f"== {name}: {' '.join(cmd[1:])} ... ")
        out.flush()
        json_path.unlink(missing_ok=True)
        start = time.perf_counter()
        # The script's own output (its table, progress bars) goes to its log, not between ours.
        with log_path.open("w") as log:
            try:
                rc = subprocess.run(
                    cmd,
                    cwd=root,
                    env=env,
                    timeout=timeout_s,
                    check=False,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        seconds = time.perf_counter() - start
        out.write(
            f"{'ok' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.1f} s "
            f"(output: {log_path})\n"
        )
        if rc != 0:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            out.write("".join(f"   | {line}\n" for line in tail))
            if rc == 124:
                out.write(f"   {name}: timed out after {timeout_s:.0f} s\n")
        bench_rows: list[BenchRow] = []
        if rc == 0 and json_path.is_file():
            bench_rows = normalize_rows(name, json.loads(json_path.read_text()))
        elif rc == 0:
            rc = 1
            out.write(f"{name}: exited 0 but wrote no {json_path}\n")
        rows += bench_rows
        runs[name] = {
            "returncode": rc,
            "seconds": round(seconds, 2),
            "rows": [asdict(r) for r in bench_rows],
        }
    summary = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": _hardware(),
        "python": platform.python_version(),
        "small": small,
        "torch": __import__("torch").__version__,
        "benchmarks": runs,
    }
    (results_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return rows, summary


def _settings(result: Mapping[str, Any]) -> str:
    """How a result was made, in one line: its device, then the script's `args` when it saved
    them, else its top-level text and integer fields (shapes, sizes)."""
    fields = result.get("args")
    if not isinstance(fields, Mapping):
        fields = {
            k: v
            for k, v in result.items()
            if k != "device" and (isinstance(v, str) or type(v) is int)
        }
    text = ", ".join(f"{k}={v}" for k, v in fields.items() if k not in ("out", "json"))
    return f"{result.get('device', '?')}: {text}"


@frozen
class RunResults:
    """One results folder read back: every row, and each file's settings line."""

    rows: list[BenchRow]
    settings: dict[str, str]  # file stem -> `_settings`
    cpu: bool  # no file names a CUDA device: GPU-only figures mean nothing


def read_results(folder: Path) -> RunResults:
    """The rows of every `<name>.json` in `folder` but `summary.json` (one run's results, e.g.
    a GPU run's copied back), by file name.

    Raises:
        ValueError: `folder` holds no result, or a file is not JSON.
    """
    rows: list[BenchRow] = []
    settings: dict[str, str] = {}
    devices: list[str] = []
    paths = sorted(p for p in folder.glob("*.json") if p.name != "summary.json")
    if not paths:
        msg = f"--report {folder}: no <name>.json results there; pass the folder a run wrote"
        raise ValueError(msg)
    for path in paths:
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            msg = f"--report: {path} is not JSON ({exc}); rerun the benchmark that wrote it"
            raise ValueError(msg) from None
        rows += normalize_rows(path.stem, result)
        if isinstance(result, Mapping):
            settings[path.stem] = _settings(result)
            devices.append(str(result.get("device", "cpu")))
    cpu = all(d.lower() == "cpu" for d in devices)  # GPU runs write "cuda" or the GPU's name
    return RunResults(rows, settings, cpu)


def report(folder: Path, out=None) -> int:
    """Print a results folder's settings, table and target verdicts (`read_results`); run
    nothing. Returns 0, or 1 when a target failed."""
    out = out or sys.stdout
    results = read_results(folder)
    out.write(f"results in {folder}:\n")
    out.write("".join(f"  {name}: {line}\n" for name, line in results.settings.items()))
    out.write(format_table(results.rows, cpu=results.cpu) + "\n")
    verdicts = [row_verdict(r) for r in results.rows if not (results.cpu and meaningless_on_cpu(r))]
    out.write(
        f"targets: {verdicts.count('pass')} pass, {verdicts.count('fail')} FAIL"
        + (" (CPU results: the targets are set for full-size GPU runs)" if results.cpu else "")
        + "\n"
    )
    return 1 if "fail" in verdicts else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="policyworker bench", description="run bench/*.py and print one table"
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", action="store_true", help="tiny shapes on CPU (smoke run)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only bench/NAME.py (repeatable)",
    )
    parser.add_argument(
        "--bench-dir",
        type=Path,
        default=None,
        help="folder of the benchmark scripts (default: the checkout's bench/)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per script")
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: print the table, settings and target verdicts of the results in DIR "
        "(e.g. a GPU run's folder copied back)",
    )


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.report is not None:
        try:
            return report(args.report)
        except ValueError as exc:
            parser.error(str(exc))
    bench_dir = args.bench_dir or default_bench_dir()
    if not bench_dir.is_dir():
        parser.error(f"--bench-dir {bench_dir}: not a folder; run from the repository checkout")
    try:
        rows, summary = run_benchmarks(
            bench_dir, small=args.small, only=args.only, timeout_s=args.timeout
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"\n{summary['date']}, {summary['hardware']}, torch {summary['torch']}"
        f"{' (--small)' if args.small else ''}"
    )
    cpu = summary["hardware"].startswith("CPU")
    print(format_table(rows, cpu=cpu) if rows else "(no rows)")
    verdicts = [row_verdict(r) for r in rows if not (cpu and meaningless_on_cpu(r))]
    print(
        f"targets: {verdicts.count('pass')} pass, {verdicts.count('fail')} FAIL"
        + (f", {sum(map(meaningless_on_cpu, rows))} GPU-only figures n/a on CPU" if cpu else "")
        + (
            " (targets are set for full-size GPU runs; on CPU they are informational)"
            if cpu
            else ""
        )
    )
    print(f"wrote {bench_dir / 'results' / 'summary.json'}")
    failed = [n for n, r in summary["benchmarks"].items() if r["returncode"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0

"""`policyworker bench`: run the modules of `bench/`, gather their JSON, print one table.

Each `bench/<name>.py` is run from the folder above it as `python -m bench.<name> [--small]
--json bench/results/<name>.json` (`--json` only when the module's source declares that option;
otherwise it must write that file itself). Modules without a `__main__` guard (`bench/common.py`)
and `_*.py` are not run. Every result has the row schema (`bench_table`); the runner writes
`bench/results/summary.json` (date, host, torch, every row, exit codes) and exits non-zero if
any bench failed. `--report DIR` runs nothing and reads a folder of results instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attrs import asdict

from policyworker._dev.bench_table import (
    BenchRow,
    format_table,
    meaningless_on_cpu,
    normalize_rows,
    report,
    row_verdict,
)

__all__ = ["default_bench_dir", "discover", "main", "run_benchmarks"]


def default_bench_dir() -> Path:
    """`bench/` beside the installed package (the repository checkout), or `./bench`."""
    beside = Path(__file__).resolve().parents[2] / "bench"
    return beside if beside.is_dir() else Path.cwd() / "bench"


def discover(bench_dir: Path, only: Sequence[str] = ()) -> list[Path]:
    """The benchmark modules, sorted: `*.py` with a `__main__` guard, not `_*.py` (helpers such
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
        cmd = [sys.executable, "-m", f"{bench_dir.name}.{name}"] + (["--small"] if small else [])
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="policyworker bench", description="run the bench/ modules and print one table"
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
        help="run only bench.NAME (repeatable)",
    )
    parser.add_argument(
        "--bench-dir",
        type=Path,
        default=None,
        help="folder of the bench modules (default: the checkout's bench/)",
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

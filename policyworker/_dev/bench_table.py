"""The table of `policyworker bench`: result rows, their verdicts, a results folder's report.

A bench writes the row schema of `bench/rows.py`::

    {"rows": [{"metric": str, "ours": float, "baseline": float | null, "baseline_name": str,
               "limit": float | str | null, "ratio": float | null, "unit": str,
               "target": str}, ...], "settings": {...}, "device": str, ...anything else...}

`ratio` defaults to ours / baseline. A row's target is a rule as text (see `row_verdict`):
its `target`, or a `limit` given as text. A JSON file without `rows` becomes one row per numeric
leaf. `report` reads a folder of results (a GPU run's copied back) and prints the same table,
each file's settings and the targets' verdicts.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import frozen

__all__ = [
    "BenchRow",
    "RunResults",
    "format_table",
    "meaningless_on_cpu",
    "normalize_rows",
    "read_results",
    "report",
    "row_verdict",
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
    baseline_name: str = ""  # what the baseline is, when the metric does not say
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
        baseline_name=str(raw.get("baseline_name") or ""),
        target=next((t for t in (raw.get("target"), limit) if isinstance(t, str)), ""),
    )


def _leaves(prefix: str, value: Any) -> list[tuple[str, float]]:
    if isinstance(value, Mapping):
        out: list[tuple[str, float]] = []
        for key, sub in value.items():
            out += _leaves(f"{prefix}.{key}" if prefix else str(key), sub)
        return out
    number = _num(value)
    return [(prefix, number)] if number is not None and math.isfinite(number) else []


def normalize_rows(bench: str, result: Any) -> list[BenchRow]:
    """Rows of one benchmark's JSON: its `rows` (the schema), or else every numeric leaf."""
    if isinstance(result, Mapping) and isinstance(result.get("rows"), list):
        return [_row(bench, raw) for raw in result["rows"]]
    if isinstance(result, list) and all(isinstance(r, Mapping) for r in result):
        return [_row(bench, raw) for raw in result]
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


def _settings(result: Mapping[str, Any]) -> str:
    """How a result was made, in one line: its device, then its `settings` (`args` in results
    written before the schema named them), else its top-level text and integer fields."""
    fields = result.get("settings", result.get("args"))
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

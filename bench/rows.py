"""The result schema every bench writes, and its one writer.

    {"rows": [{"metric": str, "ours": float | None, "unit": str,
               "baseline": float | str | None, "baseline_name": str,
               "limit": float | str | None, "ratio": float | None, "target": str}, ...],
     "settings": {...how it ran, as JSON...}, "device": str, ...anything else...}

`baseline_name` says what the baseline is (the metric may say it too: "... vs Liger");
`limit` is the physical limit (a number in the row's unit) or a rule as text; `ratio` is
ours / baseline unless the row says otherwise; `target` is a rule as text that
`policyworker bench` judges ("<= 1.05x", ">= 80% of baseline", ">= 0.4").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_result", "row", "write_result"]


def _ratio(ours: float | None, baseline: Any) -> float | None:
    if ours is None or not isinstance(baseline, int | float) or baseline == 0:
        return None
    return ours / baseline


def row(
    metric: str,
    ours: float | None,
    *,
    unit: str = "",
    baseline: float | str | None = None,
    baseline_name: str = "",
    limit: float | str | None = None,
    ratio: float | None = None,
    target: str = "",
) -> dict[str, Any]:
    """One row of the schema; `ratio` defaults to ours / baseline (None without both)."""
    return {
        "metric": metric,
        "ours": ours,
        "unit": unit,
        "baseline": baseline,
        "baseline_name": baseline_name,
        "limit": limit,
        "ratio": _ratio(ours, baseline) if ratio is None else ratio,
        "target": target,
    }


def check_result(payload: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first break of the schema: no `rows` list, a row without a
    text `metric` or a numeric-or-None `ours`, a baseline without its name, `settings` that is
    not a mapping."""
    rows = payload.get("rows")
    if not isinstance(rows, Sequence) or isinstance(rows, str):
        msg = f"rows={rows!r}: a result needs a list of rows; build them with bench.rows.row"
        raise ValueError(msg)
    for i, r in enumerate(rows):
        ours = r.get("ours") if isinstance(r, Mapping) else None
        if not isinstance(r, Mapping) or not isinstance(r.get("metric"), str):
            msg = f"rows[{i}]={r!r}: each row is a mapping with a text 'metric'"
            raise ValueError(msg)
        if ours is not None and (isinstance(ours, bool) or not isinstance(ours, int | float)):
            msg = f"rows[{i}]['ours']={ours!r}: a number or None; put text in 'metric'"
            raise ValueError(msg)
        if r.get("baseline") is not None and not r.get("baseline_name"):
            msg = (
                f"rows[{i}] ({r['metric']!r}) has a baseline but no 'baseline_name': say what "
                "the baseline is (plain HF, the per-tensor sender, ...)"
            )
            raise ValueError(msg)
    if not isinstance(payload.get("settings"), Mapping):
        msg = (
            f"settings={payload.get('settings')!r}: a result records how it ran as a mapping "
            "(the script's arguments and shapes); pass settings=vars(args)"
        )
        raise ValueError(msg)


def write_result(path: str | Path, payload: Mapping[str, Any]) -> Path:
    """Check `payload` against the schema (`check_result`) and write it as JSON to `path`."""
    check_result(payload)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    return out

"""bench/refit.py's checkpoint-engine rows: on the tiny CPU shape every backend (nixl where it
imports) refits into a receiver process, and the ipc row is summarised against our best
colocated path."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_refit_bench_small_measures_the_checkpoint_engine_beside_ours(tmp_path):
    out = tmp_path / "refit.json"
    cmd = [sys.executable, "-m", "bench.refit", "--small", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    methods = {m["method"]: m for m in result["measurements"]}
    rows = ["checkpoint-engine ipc", "checkpoint-engine collective", "one-pass", "per-tensor"]
    if importlib.util.find_spec("nixl") is not None:  # the nixl extra: its row beside ipc's
        rows.append("checkpoint-engine nixl")
        assert any("checkpoint-engine nixl (one-pass)" in r["metric"] for r in result["rows"])
    for row in rows:
        assert methods[row]["median_ms"] > 0 and len(methods[row]["times_ms"]) == 3, row
    (ipc,) = [r for r in result["rows"] if "checkpoint-engine ipc" in r["metric"]]
    assert ipc["target"].startswith("<= 1.10 x baseline")
    best = min(methods[m]["median_ms"] for m in ("default", "staged", "staged-keep", "one-pass"))
    assert ipc["baseline"] == best and ipc["ours"] == methods["checkpoint-engine ipc"]["median_ms"]

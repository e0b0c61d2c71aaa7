"""bench/inflight.py runs end to end on the tiny shape and writes rows of the schema."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_inflight_bench_small_writes_its_rows(tmp_path):
    out = tmp_path / "inflight.json"
    cmd = [sys.executable, "-m", "bench.inflight", "--small", "--steps", "24", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["metric"]: r for r in json.loads(out.read_text())["rows"]}
    swap = rows["swap between two decode steps (ours), max over refits"]
    assert swap["ours"] > 0 and swap["baseline"] > 0
    assert all(r["ours"] is not None and r["ours"] > 0 for r in rows.values())

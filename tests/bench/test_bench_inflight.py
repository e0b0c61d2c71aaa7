"""bench/inflight.py runs end to end on the tiny shape (trainer here, decoding in a spawned
inference process) and writes rows of the schema: stalls, throughputs, and no token
attributed to the wrong version."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_inflight_bench_small_writes_its_rows(tmp_path):
    out = tmp_path / "inflight.json"
    cmd = [sys.executable, "-m", "bench.inflight", "--small", "--steps", "32", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    rows = {r["metric"].split(",")[0]: r for r in result["rows"]}
    stall = rows[
        "p99 stall per refit (longest inter-token gap minus the no-refit run's gap at that step)"
    ]
    raw = rows["p99 longest raw inter-token gap per refit"]
    assert stall["target"] == "<= 0.1x" and stall["baseline"] is not None
    assert raw["ours"] > 0 and raw["baseline"] > 0 and raw["limit"] > 0
    assert rows["swap between two decode steps (ours)"]["ours"] > 0
    tps = [r for r in result["rows"] if r["metric"].startswith("decode tokens/s")]
    assert [r["metric"].rsplit(", ", 1)[1] for r in tps] == ["ours", "pause/resume"]
    assert tps[0]["target"] == ">= 95% of baseline"
    assert all(r["ours"] > 0 and r["baseline"] > 0 for r in tps)
    wrong = rows["tokens attributed to the wrong version (logprobs recomputed per version)"]
    assert wrong["ours"] == 0 and wrong["target"] == "<= 0"
    check = result["settings"]["version_check"]
    assert len(check["versions"]) >= 3  # the check compared tokens of several versions
    assert check["distinguishable"] > 0.5  # and the versions' logprobs tell them apart
    assert result["settings"]["refits_counted"] >= 2
    assert result["settings"]["inflight_swap_mode"] == "load"  # a CPU module stays staged

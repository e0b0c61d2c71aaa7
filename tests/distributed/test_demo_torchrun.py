"""`torchrun --nproc-per-node 2 -m policyworker demo --tp 2` on CPU: the distributed main job."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env, run_three_step_demo

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_demo_under_torchrun_keeps_parity_on_every_step():
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = child_env(ROOT)
    run = run_three_step_demo(
        "--tp",
        "2",
        root=ROOT,
        env=env,
        timeout=300,
        launcher=[torchrun, "--standalone", "--nproc-per-node", "2"],
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    dlogps = [float(m) for m in re.findall(r"^step=\d+ .* max_dlogp=(\S+)$", run.stdout, re.M)]
    assert len(dlogps) == 3  # rank 0 alone prints the step lines
    assert all(d <= 1e-5 for d in dlogps)
    assert re.search(r"^ok: 3 steps", run.stdout, re.M)

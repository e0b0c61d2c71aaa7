"""Ctrl-C during the demo's start-up: one interrupt ends the run with one line and exit code
130, no traceback, and no process of the run left behind (a terminal's Ctrl-C reaches the whole
process group, so the signal goes to the group here too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["torch and transformers imported", "policy worker built"])
def test_one_ctrl_c_during_start_up_ends_the_demo_with_130_and_nothing_left(stage):
    proc = subprocess.Popen(
        [sys.executable, "-m", "policyworker", "demo", "--steps", "50", "--no-require-rise"],
        cwd=ROOT,
        env=child_env(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a shell job
    )
    seen = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the start-up lines say where it is
            seen.append(line)
            if line.startswith(f"start: {stage}"):
                break
        else:
            pytest.fail(f"the demo ended before '{stage}': {''.join(seen)}")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines() == [
        "policyworker demo: interrupted; every process it started is stopped"
    ], err
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "a process of the demo outlived it"

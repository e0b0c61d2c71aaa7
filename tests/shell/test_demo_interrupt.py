"""Ctrl-C during the demo's start-up: one interrupt ends the run with one line and exit code
130, no traceback, and no process of the run left behind (a terminal's Ctrl-C reaches the whole
process group, so the signal goes to the group here too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


def _ours(err: str) -> list[str]:
    """The stderr lines but torchao's import-time warnings: where torchao is installed (the fp8
    extra), transformers imports it, and on a CPU it logs the CUDA kernels it cannot load and
    torch's deprecation of its pytree constants; none of that is the demo's."""
    return [
        line
        for line in err.strip().splitlines()
        if not (line.startswith("Failed to load ") and "torchao" in line)
        and "register_constant() on Enum subclasses" not in line
    ]


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
    assert _ours(err) == ["policyworker demo: interrupted; every process it started is stopped"], (
        err
    )
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "a process of the demo outlived it"


def test_stop_descendants_ends_children_and_grandchildren_even_orphan_to_be():
    """A child that started a grandchild (as a Ray head starts its dashboard's helpers): both
    end, the grandchild too although its parent goes first. Run in a process of its own, so
    nothing else below the test runner is touched."""
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from policyworker.demo.interrupt import descendant_pids, stop_descendants
        grandchild = "import time; time.sleep(60)"
        child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', %r]); "
        child += "time.sleep(60)"
        subprocess.Popen([sys.executable, "-c", child % grandchild])
        deadline = time.monotonic() + 30
        while len(descendant_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = descendant_pids()
        stop_descendants(timeout_s=5.0)
        print(*tree)
        """
    )
    run = _run_script(script, timeout_s=60)
    tree = [int(pid) for pid in run.stdout.split()]
    assert len(tree) == 2, run.stdout + run.stderr
    assert _gone(tree, within_s=5)


def test_stop_descendants_leaves_the_resource_tracker_to_end_by_itself():
    """multiprocessing's resource tracker ignores SIGTERM: waited for, it would hold Ctrl-C for
    the whole timeout. It is left running, and it ends once the process that started it has."""
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from multiprocessing import resource_tracker
        from policyworker.demo.interrupt import descendant_pids, stop_descendants
        resource_tracker.ensure_running()  # as a run's first spawned process starts it
        tracker = resource_tracker._resource_tracker._pid
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        start = time.monotonic()
        stop_descendants(timeout_s=30.0)
        took = time.monotonic() - start
        print(tracker, round(took, 1), child.wait(timeout=10), tracker in descendant_pids())
        """
    )
    run = _run_script(script, timeout_s=120)
    tracker, took, child_status, tracker_left = run.stdout.split()
    assert float(took) < 15.0, run.stdout  # not the 30 s timeout waited out
    assert child_status == "-15" and tracker_left == "True", run.stdout + run.stderr
    assert _gone([int(tracker)], within_s=10), "the resource tracker outlived its starter"


def _run_script(script: str, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=child_env(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )


def _gone(pids: list[int], *, within_s: float) -> bool:
    """Whether every pid has ended (or is a zombie) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

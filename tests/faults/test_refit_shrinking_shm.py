"""A peer that shrinks a shared-memory file mid-copy gets a ``RefitError`` naming the file; the
other side lives on (before the fix: a SIGBUS that killed the receiver or the trainer). Each
scenario runs in a fresh process so that a regression fails its test, not the session."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import child_env

pytestmark = pytest.mark.faults


def _run(name: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults.shrinking_shm", name],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@{")]
    assert lines, f"the scenario process ended with code {proc.returncode}: {proc.stderr[-1500:]}"
    return json.loads(lines[-1][2:])


def test_a_staging_file_shrunk_after_the_receiver_opened_it_is_no_sigbus():
    result = _run("staged")
    assert result["ok"], result["detail"]


def test_a_one_pass_arena_shrunk_by_its_receiver_is_a_named_refit_error_for_the_trainer():
    result = _run("one_pass")
    assert result["ok"], result["detail"]

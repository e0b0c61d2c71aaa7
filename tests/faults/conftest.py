"""The fault tier: every test here injects a real fault (SIGKILL, a full tmpfs, a truncated
file, a racing thread, an oversized frame) and checks the outcome named in issues 18 and 21.

Refit files and sockets go to private folders (short paths: a Unix socket path holds 107 bytes),
so the orphan cleanup a sender runs at start never touches another process's refit."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest

from policyworker.shell.refit.zmq import ipc_files
from tests.faults import scenarios


@pytest.fixture(scope="session")
def _private_folders():
    """One private shm folder and temp folder for the session (a process's multiprocessing
    folder lives in the temp folder until its exit, so that one is only emptied here)."""
    shm = tempfile.mkdtemp(prefix="pwf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    tmp = tempfile.mkdtemp(prefix="pwf-", dir="/tmp")
    yield shm, tmp
    shutil.rmtree(shm, ignore_errors=True)
    for name in os.listdir(tmp):
        if not name.startswith("pymp-"):  # multiprocessing removes its own at exit
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(tmp)


@pytest.fixture(autouse=True)
def private_refit_folders(_private_folders, monkeypatch):
    shm, tmp = _private_folders
    monkeypatch.setattr(ipc_files, "SHM_DIR", shm)
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    monkeypatch.setenv("POLICYWORKER_SHM_DIR", shm)
    monkeypatch.setenv("TMPDIR", tmp)


def run_here(name: str, trials: int, *args: str) -> list[dict]:
    """Run a scenario in this process; its per-trial results."""
    scenarios.RESULTS = []
    try:
        scenarios.SCENARIOS[name](trials, *args)
        return scenarios.RESULTS
    finally:
        scenarios.RESULTS = None


def run_apart(name: str, trials: int, *args: str, timeout_s: float = 150.0) -> list[dict]:
    """Run a scenario in a fresh process (a fault there may kill it: SIGBUS, a libzmq abort);
    its per-trial results, with the exit status named when it died before the last trial."""
    results, code, stderr = scenarios.run_scenario(name, trials, *args, timeout_s=timeout_s)
    if code != 0 or len(results) < trials:
        died = f"signal {-code}" if code < 0 else f"exit code {code}"
        results.append(
            {
                "trial": len(results),
                "ok": False,
                "detail": f"the scenario process ended with {died}: {stderr[-800:]}",
            }
        )
    return results


def assert_all_ok(results: list[dict], trials: int) -> None:
    failed = [r for r in results if not r["ok"]]
    assert not failed and len(results) >= trials, (
        "\n".join(f"trial {r['trial']}: {r['detail']}" for r in failed)
        or f"only {len(results)} trials ran"
    )

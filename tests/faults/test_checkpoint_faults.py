"""Checkpoint faults: saves racing under one root, a failing DCP write, Ctrl-C in an async save."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from policyworker.shell import checkpoint as ck
from tests.faults import checkpoint_children as children
from tests.helpers import child_env
from tests.shell.checkpoint import checkpoint_crash_child as crash_child

pytestmark = pytest.mark.faults


def test_two_processes_saving_under_one_root_never_delete_each_others_staged_folders(tmp_path):
    """Each save of two processes into the same folders succeeds, and the last commit loads
    whole: a save clears only staged folders no live process claims."""
    root, go = tmp_path / "run", tmp_path / "go"
    context = multiprocessing.get_context("fork")
    results = [tmp_path / f"result{i}" for i in range(2)]
    procs = [
        context.Process(target=children.save_loop, args=(str(root), str(go), str(r), 8))
        for r in results
    ]
    for proc in procs:
        proc.start()
    go.touch()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    outcomes = [r.read_text() if r.exists() else "no result" for r in results]
    assert outcomes == ["ok", "ok"], "\n".join(outcomes)
    worker = crash_child.SimpleWorker(crash_child.build_model(seed=1))
    ck.load_checkpoint(worker, root / "weights", root / "optimizer")
    assert sorted(os.listdir(root / "weights")) == ["model", "reference"]
    assert sorted(os.listdir(root / "optimizer")) == ["optim"]


def test_a_stale_staged_folder_of_a_dead_save_is_still_cleared(tmp_path):
    root = tmp_path / "run"
    dead = root / "weights" / "model.tmp-deadbeef0000"
    dead.mkdir(parents=True)
    (root / "weights" / "model.tmp-deadbeef0000.lock").write_text("host 1\n")  # unlocked
    worker = crash_child.SimpleWorker(crash_child.build_model())
    ck.save_checkpoint(worker, root / "weights", is_final_checkpoint=True)
    assert sorted(os.listdir(root / "weights")) == ["model", "reference"]


def test_a_failed_async_dcp_write_is_a_checkpoint_error_with_the_cause(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    worker = crash_child.SimpleWorker(crash_child.build_model())
    worker.model(torch.ones(1, 256)).sum().backward()
    worker.optimizer.step()
    ck.save_checkpoint(worker, tmp_path / "w", tmp_path / "o")
    with pytest.raises(ck.CheckpointError, match=r"optim\.tmp-.*failed in torch.distributed") as e:
        ck.finalize_async_save(worker)
    assert isinstance(e.value.__cause__, CheckpointException)
    assert not list((tmp_path / "o").glob("optim.tmp-*"))  # nothing staged is left


def test_ctrl_c_during_an_async_save_removes_its_staged_folders_and_says_so(tmp_path):
    root = tmp_path / "run"
    script = (
        "from tests.faults import checkpoint_children as c\n"
        f"c.interrupted_async_save({str(root)!r})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pathlib.Path(__file__).parents[2],
    )
    assert "KeyboardInterrupt" in done.stderr, done.stderr
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp-*"))
    assert left == [], done.stderr
    assert "were removed" in done.stderr and "model.tmp-" in done.stderr
    assert "finalize_async_save" not in done.stderr

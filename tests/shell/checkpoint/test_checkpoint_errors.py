"""Optimizer state of another optimizer class is one CheckpointError line, before DCP reads."""

from __future__ import annotations

import pytest
import torch

from policyworker.shell import checkpoint as ck
from tests.shell.checkpoint import checkpoint_crash_child as child


def test_adamw_state_into_an_sgd_worker_is_one_line_naming_both(tmp_path):
    adamw = child.SimpleWorker(child.build_model())
    adamw.model(torch.ones(1, 256)).sum().backward()
    adamw.optimizer.step()
    ck.save_checkpoint(adamw, tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    sgd = child.SimpleWorker(child.build_model(seed=1))
    sgd.optimizer = torch.optim.SGD(sgd.model.parameters(), lr=0.1)
    sgd.scheduler = None
    before = [p.detach().clone() for p in sgd.model.parameters()]
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(sgd, tmp_path / "w", tmp_path / "o")
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    assert "another optimizer than this worker's SGD" in message
    assert "'momentum'" in message and "'exp_avg'" in message and "optimizer_path=None" in message
    assert all(torch.equal(a, b) for a, b in zip(before, sgd.model.parameters(), strict=True))

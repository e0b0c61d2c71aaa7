"""Moving optimizer state keeps torch's placement of the step counter: on the host for a plain
optimizer (its bias correction reads the counter per parameter), with the moments for a fused
or capturable one."""

from __future__ import annotations

import pytest
import torch

from policyworker.shell.worker.offload import _move_optimizer_state  # pyright: ignore[reportPrivateUsage]


def _stepped(flag: str | None = None) -> torch.optim.Optimizer:
    """One AdamW step on the host; `flag` (fused, capturable, foreach) is set on the group
    afterwards, as the device optimizer it stands for would carry it (neither runs on a CPU)."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    if flag is not None:
        optimizer.param_groups[0][flag] = True
    return optimizer


def _devices(optimizer: torch.optim.Optimizer) -> set[tuple[str, str]]:
    return {
        (key, value.device.type)
        for opt_state in optimizer.state.values()
        for key, value in opt_state.items()
    }


def test_a_plain_optimizer_keeps_its_step_counter_on_the_host():
    optimizer = _stepped()
    _move_optimizer_state(optimizer, torch.device("meta"))
    assert _devices(optimizer) == {("step", "cpu"), ("exp_avg", "meta"), ("exp_avg_sq", "meta")}


@pytest.mark.parametrize("flag", ["capturable", "fused", "foreach"])
def test_the_step_counter_follows_the_moments_only_where_torch_keeps_it_there(flag: str):
    optimizer = _stepped(flag)
    _move_optimizer_state(optimizer, torch.device("meta"))
    step_device = "cpu" if flag == "foreach" else "meta"
    assert ("step", step_device) in _devices(optimizer)
    assert ("exp_avg", "meta") in _devices(optimizer)

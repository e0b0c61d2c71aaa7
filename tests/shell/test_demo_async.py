"""`policyworker demo --async`: the refit streams while the HF inference process samples; the
reward still rises, parity stays exact, each step prints the version lag and the stall."""

import io
import re

import pytest
import torch

from policyworker.demo.async_steps import policy_versions, stall_ms
from policyworker.demo.loop import run_demo
from policyworker.demo.options import DemoOptions

ASYNC_RE = re.compile(
    r"^step=(\d+) .* max_dlogp=(\S+)  lag max (\d+) mean ([0-9.]+)  stall ([0-9.]+) ms$"
)


@pytest.mark.slow
def test_async_demo_learns_with_exact_parity_and_reports_lag_and_stall():
    out, err = io.StringIO(), io.StringIO()
    result = run_demo(DemoOptions(steps=20, inflight=True), out=out, err=err)
    assert result.exit_code == 0, out.getvalue() + err.getvalue()
    steps = [
        ASYNC_RE.match(line) for line in out.getvalue().splitlines() if line.startswith("step=")
    ]
    assert len(steps) == 20 and all(steps), out.getvalue()
    assert all(float(m.group(2)) == 0.0 for m in steps)  # scored under the weights just sent
    lags = [int(m.group(3)) for m in steps]
    assert lags[0] == 0 and all(lag <= 1 for lag in lags)  # one refit in flight at a time
    assert all(float(m.group(5)) > 0.0 for m in steps)  # every step swapped once


@pytest.mark.parametrize("opts", [{"tp": 2}, {"ray": 2}], ids=["tp", "ray"])
def test_async_is_refused_outside_one_trainer_process(opts):
    with pytest.raises(ValueError, match="--async"):
        run_demo(DemoOptions(inflight=True, **opts), out=io.StringIO(), err=io.StringIO())


def test_token_tags_map_onto_the_policy_version_each_refit_carried():
    tags = [[0, 0, 1, 2], [2, 2, 2, 2]]
    assert torch.equal(policy_versions(tags, [0, 3]), torch.tensor([[0, 0, 0, 3], [3, 3, 3, 3]]))
    assert stall_ms({"swaps": [(1, 0.002), (2, 0.001)]}) == 2.0
    assert stall_ms({"swaps": []}) == 0.0

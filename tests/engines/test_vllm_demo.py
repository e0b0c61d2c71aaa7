"""`policyworker demo --engine vllm --steps 3`: real vLLM rollouts, every refit through vLLM's
weight-sync calls, fp32 parity with get_logprobs checked on every step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.engines.vllm_helpers import require_vllm
from tests.helpers import child_env, run_three_step_demo

require_vllm()

from policyworker.demo.options import VLLM_FP32_TOLERANCE  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEP_RE = re.compile(
    r"^step=(\d+) reward=([0-9.]+) kl=(-?[0-9.]+) refit_ms=([0-9.]+) "
    r"max_dlogp=(\S+) token_mult_prob_error=([0-9.]+)$"
)


@pytest.mark.slow
def test_three_step_vllm_demo_runs_with_fp32_parity_on_every_step():
    env = child_env(ROOT, VLLM_CPU_KVCACHE_SPACE="1")
    run = run_three_step_demo("--engine", "vllm", root=ROOT, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    steps = [STEP_RE.match(line) for line in run.stdout.splitlines() if line.startswith("step=")]
    assert len(steps) == 3 and all(steps), run.stdout
    assert [int(m.group(1)) for m in steps] == [1, 2, 3]
    for m in steps:
        assert float(m.group(5)) <= VLLM_FP32_TOLERANCE  # max |lp_train - lp_gen|
        assert 1.0 <= float(m.group(6)) <= 1.0 + VLLM_FP32_TOLERANCE
        assert float(m.group(4)) > 0.0  # a refit reached vLLM before every step
    assert re.search(r"^ok: 3 steps", run.stdout, re.M)
    assert "vLLM engine started in" in run.stderr
    # Expected vLLM noise is filtered (shell/engines/vllm_logs.py), in every process of the run.
    for noise in ("Failed to load weights", "Chat template warmup failed", "force killing"):
        assert noise not in run.stdout + run.stderr, noise

"""The bf16-on-a-CPU warning: said once at start-up where the CPU lacks bf16 instructions, with
the measured slowdown and the fix; silent where bf16 is native (avx512_bf16, AMX) or unused."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from policyworker.shell.worker.cpu_precision import (
    BF16_CPU_SLOWDOWN,
    bf16_cpu_message,
    cpu_has_bf16,
)
from tests.helpers import ChildRun, child_env, save_tiny_llama

ROOT = Path(__file__).resolve().parents[3]


def test_the_message_names_the_slowdown_and_the_fix_only_for_bf16_on_a_cpu_without_it():
    message = bf16_cpu_message(device_type="cpu", dtype=torch.bfloat16, has_bf16=False)
    assert BF16_CPU_SLOWDOWN in message and "policy.precision: fp32" in message
    for kwargs in (
        dict(device_type="cpu", dtype=torch.bfloat16, has_bf16=True),  # AVX512-BF16 or AMX
        dict(device_type="cpu", dtype=torch.bfloat16, has_bf16=None),  # cannot tell: say nothing
        dict(device_type="cpu", dtype=torch.float32, has_bf16=False),
        dict(device_type="cuda", dtype=torch.bfloat16, has_bf16=False),
    ):
        assert bf16_cpu_message(**kwargs) == "", kwargs


_WORKERS = textwrap.dedent(
    """
    import sys
    from policyworker import PolicyWorker
    from policyworker.shell.worker.cpu_precision import cpu_has_bf16
    print("has_bf16", cpu_has_bf16(), flush=True)
    for precision in sys.argv[2:]:
        cfg = {"model_name": sys.argv[1], "precision": precision, "train_global_batch_size": 2,
               "train_micro_batch_size": 2, "logprob_batch_size": 2}
        PolicyWorker(cfg, init_optimizer=False, init_reference_model=False).shutdown()
    """
)


# ONEDNN_MAX_CPU_ISA=AVX2 emulates a CPU without bf16 only on x86
EMULATES_NO_BF16 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
# Each test's worker start-ups, in an interpreter of its own (the warning is said once per
# process): (precisions, extra environment).
RUNS = {
    "two_bf16": (
        ("bf16", "bf16", "fp32"),
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    ),
    "this_cpu": (("bf16",), {}),
    "fp32": (("fp32",), {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("cpu_precision") / "model")


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every run of `RUNS` the module's tests need, started at once; each test waits for its own."""
    log_dir = tmp_path_factory.mktemp("cpu_precision_runs")
    started = {
        key: ChildRun(
            [sys.executable, "-c", _WORKERS, tiny_model, *precisions],
            cwd=ROOT,
            env=child_env(ROOT, **env),
            log_dir=log_dir,
            name=key,
        )
        for key, (precisions, env) in RUNS.items()
        if key != "two_bf16" or EMULATES_NO_BF16
    }
    yield started
    for run in started.values():
        run.kill()


def _finished(runs, key: str) -> subprocess.CompletedProcess[str]:
    run = runs[key].result(timeout=300)
    run.check_returncode()
    return run


@pytest.mark.skipif(
    not EMULATES_NO_BF16,
    reason="ONEDNN_MAX_CPU_ISA=AVX2 emulates a CPU without bf16 only on x86",
)
def test_two_bf16_workers_on_a_cpu_without_bf16_warn_once(runs):
    run = _finished(runs, "two_bf16")
    assert "has_bf16 False" in run.stdout
    assert run.stderr.count("precision bf16 on a CPU without bf16 instructions") == 1, run.stderr
    assert BF16_CPU_SLOWDOWN in run.stderr


def test_this_cpu_warns_exactly_when_torch_reports_no_bf16(runs):
    run = _finished(runs, "this_cpu")
    warned = "precision bf16 on a CPU without bf16 instructions" in run.stderr
    assert warned == (cpu_has_bf16() is False), run.stdout + run.stderr


def test_fp32_never_warns(runs):
    run = _finished(runs, "fp32")
    assert "without bf16 instructions" not in run.stderr

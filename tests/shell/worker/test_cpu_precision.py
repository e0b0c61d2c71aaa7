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
from tests.helpers import child_env, save_tiny_llama

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


def _start_workers(model: str, *precisions: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WORKERS, model, *precisions],
        cwd=ROOT,
        env=child_env(ROOT, **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("cpu_precision") / "model")


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="ONEDNN_MAX_CPU_ISA=AVX2 emulates a CPU without bf16 only on x86",
)
def test_two_bf16_workers_on_a_cpu_without_bf16_warn_once(tiny_model):
    run = _start_workers(
        tiny_model, "bf16", "bf16", "fp32", ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2"
    )
    assert "has_bf16 False" in run.stdout
    assert run.stderr.count("precision bf16 on a CPU without bf16 instructions") == 1, run.stderr
    assert BF16_CPU_SLOWDOWN in run.stderr


def test_this_cpu_warns_exactly_when_torch_reports_no_bf16(tiny_model):
    run = _start_workers(tiny_model, "bf16")
    warned = "precision bf16 on a CPU without bf16 instructions" in run.stderr
    assert warned == (cpu_has_bf16() is False), run.stdout + run.stderr


def test_fp32_never_warns(tiny_model):
    run = _start_workers(tiny_model, "fp32", ONEDNN_MAX_CPU_ISA="AVX2")
    assert "without bf16 instructions" not in run.stderr

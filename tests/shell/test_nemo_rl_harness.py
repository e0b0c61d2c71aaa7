"""The NeMo-RL test harness: tests read from a snapshot, `nemo_rl` imports resolved to
policyworker.nemo_rl, a missing name failing only the tests that use it, counts per file."""

import subprocess
from collections import Counter

import pytest

from policyworker._dev import nemo_rl_harness as harness

PACKING_TESTS = """
import torch
from nemo_rl.data.packing.algorithms import PackingAlgorithm, get_packer
from nemo_rl.algorithms.loss.interfaces import SomethingWeDoNotHave


def test_packs():
    assert get_packer(PackingAlgorithm.CONCATENATIVE, 10).pack([4, 4, 4]) == [[0, 1], [2]]


def test_uses_a_missing_name():
    SomethingWeDoNotHave()


def test_cuda_is_the_cpu():
    assert torch.cuda.is_available()
    assert torch.zeros(2, device="cuda").to("cuda").device.type in ("cpu", "cuda")
"""


def _snapshot(root):
    for path in harness.TEST_FILES:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        body = PACKING_TESTS if "packing" in path else "import nemo_rl_absent_module_x\n"
        (root / path).write_text(body)
    return root


def test_the_harness_runs_a_checkout_and_counts_per_file(tmp_path):
    source = _snapshot(tmp_path / "RL")
    counts = harness.run(source, tmp_path / "work", ["-q"])
    assert counts["tests/unit/data/packing/test_algorithms.py"] == Counter(passed=2, failed=1)
    for path in harness.TEST_FILES:
        if "packing" not in path:
            assert counts[path] == Counter(errors=1)
    lines = harness.format_counts(counts).splitlines()
    assert "tests/unit/data/packing/test_algorithms.py: 2/3 passed, 1 failed, 0 errors" in lines[2]


def test_a_bare_git_directory_is_read_at_head(tmp_path):
    work = _snapshot(tmp_path / "RL")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "t"]):
        subprocess.run([*git, *args], check=True, timeout=60)
    text = harness.read_snapshot_file(work / ".git", harness.TEST_FILES[2])
    assert "get_packer" in text
    with pytest.raises(FileNotFoundError, match="not in the NeMo-RL snapshot"):
        harness.read_snapshot_file(tmp_path, "tests/unit/nope.py")

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


# NeMo-RL's loss package in miniature, written as NeMo-RL writes it: its own enums, positional
# calls, helpers imported from other nemo_rl modules.
FAKE_INTERFACES = """
import enum

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"
"""

FAKE_LOSSES = """
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
from nemo_rl.algorithms.utils import masked_mean
from nemo_rl.distributed.model_utils import vocab_parallel_nothing_here


class NLLLossFn:
    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
        gvt = global_valid_toks
        loss = -masked_mean(next_token_logprobs, mask, global_normalization_factor=gvt)
        return loss, {"loss": loss.item(), "num_valid_samples": data["sample_mask"].sum().item()}


class ClippedPGLossConfig:
    def __init__(self, **cfg):
        self.cfg = cfg


class ClippedPGLossFn(NLLLossFn):
    def __init__(self, cfg):
        assert isinstance(cfg, ClippedPGLossConfig)

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        return vocab_parallel_nothing_here(next_token_logprobs)
"""


def _loss_snapshot(root):
    package = root / harness.LOSS_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from nemo_rl.algorithms.loss.loss_functions import NLLLossFn\n"
    )
    (package / "interfaces.py").write_text(FAKE_INTERFACES)
    (package / "loss_functions.py").write_text(FAKE_LOSSES)
    return root


def test_the_losses_mode_trains_nemo_rl_loss_classes_and_says_why_one_does_not(tmp_path):
    source = _loss_snapshot(tmp_path / "RL")
    lines = harness.run_losses(source, tmp_path / "work")
    assert len(lines) == 3, lines
    assert lines[0].startswith("NLLLossFn: trained (loss "), lines[0]
    assert "|diff| 0.0e+00" in lines[0] and "rtol 1e-05, atol 1e-06" in lines[0]
    assert lines[1] == (
        "ClippedPGLossFn: failed (NotImplementedError: "
        "nemo_rl.distributed.model_utils.vocab_parallel_nothing_here has no policyworker face)"
    )
    assert lines[2] == "DPOLossFn: failed (NeMo-RL's loss_functions has no DPOLossFn)"
    # the loss package was extracted as it is, beside the hook
    assert (tmp_path / "work" / harness.LOSS_PACKAGE / "loss_functions.py").read_text() == (
        FAKE_LOSSES
    )


def test_the_losses_mode_lists_a_bare_git_directory_and_refuses_a_snapshot_without_losses(
    tmp_path,
):
    work = _loss_snapshot(tmp_path / "RL")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "t"]):
        subprocess.run([*git, *args], check=True, timeout=60)
    written = harness.extract_losses(work / ".git", tmp_path / "out")
    assert written == [
        f"{harness.LOSS_PACKAGE}/{n}.py" for n in ("__init__", "interfaces", "loss_functions")
    ]
    assert (tmp_path / "out" / "nemo_rl_hook.py").read_text() == harness.HOOK
    with pytest.raises(FileNotFoundError, match="loss_functions.py is not in the NeMo-RL snapshot"):
        harness.extract_losses(tmp_path / "out" / "nemo_rl", tmp_path / "again")

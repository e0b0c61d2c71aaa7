"""docs/custom-loss.md: its minimal custom loss runs as written, and the error it quotes is the
one the worker raises."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch

from policyworker.functional.loss_protocol import check_loss_output
from tests.helpers import child_env

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "custom-loss.md").read_text()


def test_the_minimal_custom_loss_of_the_doc_trains_as_written(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC, re.S)
    assert len(blocks) == 1 and "class AdvantageWeightedNLL" in blocks[0]
    script = tmp_path / "custom_loss.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + blocks[0])
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(ROOT),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert re.search(r"^loss \[-?\d", done.stdout, re.M), done.stdout


def test_the_doc_quotes_the_message_a_per_token_loss_gets():
    quoted = re.search(r"```\n(ValueError: loss_fn MyLoss .*?): \.\.\.\n```", DOC, re.S)
    assert quoted is not None
    loss = torch.zeros(4, 11, requires_grad=True)
    with pytest.raises(ValueError) as raised:
        check_loss_output(
            (loss, {"num_valid_samples": 4.0}), owner="loss_fn MyLoss", needs_grad=True
        )
    assert f"ValueError: {raised.value}".startswith(" ".join(quoted.group(1).split()))

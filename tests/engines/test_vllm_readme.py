"""The README's vLLM example, run as the script a user would save (it must work as printed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.engines.vllm_helpers import require_vllm
from tests.helpers import run_script

require_vllm()

ROOT = Path(__file__).resolve().parents[2]


def readme_vllm_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- vllm-example -->\n```python\n(.*?)\n```", text, re.S)
    assert match, "README.md lost its <!-- vllm-example --> python block"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_vllm_example_trains_refits_and_samples(tmp_path):
    source = readme_vllm_example() + "\n"
    run = run_script(tmp_path / "vllm_example.py", source, ROOT, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    refit = re.search(r"^refit: \{.*'version': 1.*\}$", run.stdout, re.M)
    assert refit, run.stdout
    sampled = re.search(r"^vLLM sampled: \[(\d+), (\d+), (\d+), (\d+)\]$", run.stdout, re.M)
    assert sampled, run.stdout

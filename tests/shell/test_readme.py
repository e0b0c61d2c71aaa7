"""The README's python code blocks run as written (each in a fresh interpreter)."""

import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import child_env

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# The vLLM example (marked <!-- vllm-example -->) needs the vllm extra and its own engine:
# tests/engines/test_vllm_readme.py runs it.
_FOUND = re.findall(r"(<!-- vllm-example -->\n)?```python\n(.*?)```", README.read_text(),
                    flags=re.S)
BLOCKS = [block for marker, block in _FOUND if not marker]


def test_the_readme_has_a_python_quickstart():
    assert BLOCKS and "PolicyWorker" in BLOCKS[0] and "HFWeightReceiver" in BLOCKS[0]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + BLOCKS[index])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=child_env(README.parent), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

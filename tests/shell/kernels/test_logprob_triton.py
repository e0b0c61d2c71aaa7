"""The Triton logprob pair (`shell.logprob_triton`, the fused kernels on CUDA) on CPU, through
Triton's interpreter in a child process; tests/gpu checks it compiled, at a real vocab."""

import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("logprob_triton_child.py")
ROOT = Path(__file__).resolve().parents[3]


def test_triton_pair_matches_eager_values_and_gradients_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "match the eager pair" in done.stdout

"""The README's "Weights in flight" example runs as printed: a refit streams while the HF
sampler decodes, the swap lands between two decode steps, every token carries its version."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- inflight-example -->\n```python\n(.*?)\n```", text, re.S)
    assert match, "README.md lost its <!-- inflight-example --> python block"
    return match.group(1)


def test_the_readme_inflight_example_swaps_between_decode_steps(tmp_path):
    script = tmp_path / "inflight_example.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + _example() + "\n")
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=child_env(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    found = re.search(r"^token versions, row 0: (\[.*\])$", run.stdout, re.M)
    assert found, run.stdout
    versions = ast.literal_eval(found.group(1))
    assert len(versions) == 16 and versions[:3] == [0, 0, 0]  # streamed from step 2 on
    assert versions == sorted(versions) and set(versions) <= {0, 1}
    swaps = re.search(r"^swaps \(version, seconds\): (\[.*\])$", run.stdout, re.M)
    assert swaps, run.stdout
    assert len(ast.literal_eval(swaps.group(1))) == (1 if 1 in versions else 0)
    assert "serving the trainer's weights: True" in run.stdout

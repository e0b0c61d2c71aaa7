"""The README's "Weights in flight" example runs as printed: a refit streams while the HF
sampler decodes, the swap lands between two decode steps, every token carries its version."""

import ast
import re
from pathlib import Path

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- inflight-example -->\n```python\n(.*?)\n```", text, re.S)
    assert match, "README.md lost its <!-- inflight-example --> python block"
    return match.group(1)


def test_the_readme_inflight_example_swaps_between_decode_steps(tmp_path):
    source = "import torch\ntorch.set_num_threads(1)\n" + _example() + "\n"
    run = run_script(tmp_path / "inflight_example.py", source, ROOT, timeout=300)
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

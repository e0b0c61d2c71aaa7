"""The README's python code blocks run as written.

The Quickstart block runs here in a fresh interpreter; every other python block must be executed
by a test of its own (one that names the block's section or its `<!-- ... -->` marker), so no
block of the README can go stale unexecuted.
"""

import pathlib
import re
import subprocess
import sys

from tests.helpers import child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _python_blocks() -> list[tuple[str, str, str]]:
    """(section heading, marker comment or '', code) of every python block, in order."""
    blocks, heading = [], ""
    pattern = re.compile(r"^## ([^\n]+)$|(<!-- [^>]* -->\n)?```python\n(.*?)```", re.M | re.S)
    for match in pattern.finditer(README):
        if match.group(1) is not None:
            heading = match.group(1).strip()
        else:
            blocks.append((heading, (match.group(2) or "").strip(), match.group(3)))
    return blocks


def test_the_quickstart_runs_as_written(tmp_path):
    quick = [code for heading, _, code in _python_blocks() if heading == "Quickstart"]
    assert len(quick) == 1 and "HFWeightReceiver" in quick[0]
    script = tmp_path / "quickstart.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + quick[0])
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(ROOT),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "loss [" in done.stdout


def test_every_other_readme_block_is_executed_by_a_test():
    tests = [
        p.read_text()
        for p in (ROOT / "tests").rglob("*.py")
        if p.name != pathlib.Path(__file__).name
    ]
    for heading, marker, _ in _python_blocks():
        if heading == "Quickstart":
            continue
        names = [n for n in (marker.removeprefix("<!-- ").removesuffix(" -->"), heading) if n]
        assert any(name in text for name in names for text in tests), (
            f"the README block under '## {heading}' {marker} is executed by no test; add one"
        )

"""`make demo` builds the lean demo environment (torch and the runtime dependencies, with a
progress line per stage); `make test` keeps the full one. Read from `make -n` (nothing runs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.fail("make is not installed; the Makefile cannot be checked")
    run = subprocess.run(
        [
            "make",
            "-n",
            "--no-print-directory",
            target,
            f"VENV={tmp_path}/full",
            f"DEMO_VENV={tmp_path}/demo",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return run.stdout


def test_make_demo_installs_only_torch_and_the_package_into_its_own_environment(tmp_path):
    commands = _dry_run("demo", tmp_path)
    installs = [line for line in commands.splitlines() if " install " in line]
    assert installs and all(line.startswith(f"{tmp_path}/demo/bin/pip") for line in installs)
    assert any('"torch==' in line for line in installs)
    assert any(line.rstrip().endswith("install --quiet -e .") for line in installs)
    for heavy in ("vllm", "ray", "[test]", "pyright", "ruff", "triton"):
        assert heavy not in commands, heavy
    assert f"{tmp_path}/full" not in commands  # the full environment is not built for the demo
    assert commands.rstrip().endswith(f"{tmp_path}/demo/bin/policyworker demo")


def test_make_demo_says_what_it_is_installing_stage_by_stage(tmp_path):
    stages = [
        line for line in _dry_run("demo", tmp_path).splitlines() if "demo environment" in line
    ]
    assert [s.split("demo environment ")[1][:3] for s in stages] == ["1/4", "2/4", "3/4", "4/4"]


def test_make_test_keeps_the_full_environment_with_vllm_and_the_toolchain(tmp_path):
    commands = _dry_run("test", tmp_path)
    assert "vllm" in commands and '-e ".[test]"' in commands
    assert f"{tmp_path}/demo" not in commands


@pytest.mark.slow
def test_a_built_wheel_ships_py_typed_and_the_package_only(tmp_path):
    """The README's install-from-a-wheel route: the wheel carries `py.typed` (PEP 561)."""
    import sys
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("policyworker-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "policyworker/py.typed" in names
    assert "policyworker/cli.py" in names and not any(n.startswith("tests/") for n in names)

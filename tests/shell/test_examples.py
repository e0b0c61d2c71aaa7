"""The examples in examples/ run as a user would run them (a fresh interpreter each), and the
README links every one of them."""

import re
import sys
from pathlib import Path

import pytest

from tests.helpers import ChildRun, child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
# What each example must print when it did its job (its own asserts also fail the exit code).
EXPECTED = {
    "grpo_minimal.py": [
        r"step 2: loss -?\d",
        r"logprobs identical = True",
        r"max \|logprob gap\| trainer vs inference process = 0\.00e\+00",
        r"PolicyWorker ready: model=\S+ \(llama, ",
    ],
    "sft_dpo.py": [r"sft step 2: nll \d", r"dpo step 2: loss \d", r"PolicyWorker\(model="],
    "nemo_rl_yaml.py": [
        r"precision: bfloat16",
        r"'train/global_loss': -?\d",
        r"DynamicBatchingConfig\(train_mb_tokens=64",
    ],
}


def test_every_example_is_tested_and_linked_from_the_readme():
    assert sorted(EXPECTED) == EXAMPLES
    readme = (ROOT / "README.md").read_text()
    for name in [*EXAMPLES, "nemo_rl_grpo.yaml"]:
        assert f"(examples/{name})" in readme, f"README does not link examples/{name}"


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """Every example started at once, each in a fresh interpreter (they share nothing: each
    writes under its own temporary folder); each test waits for its own."""
    log_dir = tmp_path_factory.mktemp("examples")
    runs = {
        name: ChildRun(
            [sys.executable, str(ROOT / "examples" / name)],
            cwd=ROOT,
            env=child_env(ROOT),
            log_dir=log_dir,
            name=name,
        )
        for name in EXAMPLES
    }
    yield runs
    for run in runs.values():
        run.kill()


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_prints_its_results(example_runs, name):
    run = example_runs[name].result(timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    for pattern in EXPECTED[name]:
        assert re.search(pattern, output), f"{pattern!r} not in the output:\n{output[-4000:]}"
    assert "it/s]" not in output, f"a progress bar leaked into the output:\n{output[-4000:]}"

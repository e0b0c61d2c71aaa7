"""examples/grpo runs as a user runs it: `policyworker grpo --config examples/grpo/run.yaml`
in a fresh interpreter, 3 steps on CPU with the hf engine, on a tiny model with a tokenizer."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from policyworker.testing import tiny_model_folder
from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "examples/grpo/run.yaml"


@pytest.mark.slow
def test_the_example_run_file_trains_three_steps_and_checkpoints(tmp_path):
    model = tiny_model_folder(tmp_path / "model", tokenizer=True, eos_token_id=1)
    overrides = [
        f"policy.model_name={model}",
        "grpo.max_num_steps=3",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
    ]
    plot = tmp_path / "curve.png"
    command = ["grpo", "--config", str(RUN), "--plot", str(plot), *overrides]
    run = subprocess.run(
        [sys.executable, "-m", "policyworker", *command],
        cwd=tmp_path,
        env=child_env(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    start = rf"grpo: {re.escape(str(model))} on \w+, 16 prompts, generation backend hf, 3 steps"
    assert re.search(start, run.stdout), output[-4000:]
    for step in (1, 2, 3):
        line = rf"step {step}/3  reward \d\.\d{{4}}  kl -?\d\.\d+  loss -?\d\.\d+  tok/s \d"
        assert re.search(line + r".*refit \d+\.\d ms  step \d+\.\d\d s", output), output[-4000:]
    assert re.search(r"grpo: 3 steps in \d+\.\d s; reward", output), output[-4000:]
    assert "it/s]" not in output, f"a progress bar leaked into the output:\n{output[-4000:]}"
    logged = [json.loads(x) for x in (tmp_path / "logs/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert (tmp_path / "ckpt/step_3/grpo_state.json").is_file()  # the last step always saves
    assert f"plot: {plot}" in output and plot.read_bytes().startswith(b"\x89PNG")


def test_a_bad_override_is_reported_before_anything_starts(tmp_path, capsys):
    from policyworker.cli import main

    code = main(["grpo", "--config", str(RUN), "grpo.max_num_steps=0", "policy.precision=fp7"])
    err = capsys.readouterr().err
    assert code == 2
    assert "@ grpo.max_num_steps" in err and "@ policy.precision" in err
    code = main(["grpo", "--config", str(RUN), "--plot", str(tmp_path / "no/dir/x.png")])
    assert code == 2 and "does not exist" in capsys.readouterr().err

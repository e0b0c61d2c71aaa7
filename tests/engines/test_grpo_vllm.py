"""`policyworker grpo` with `generation.backend: vllm`: the example run file, 3 steps, a real
vLLM engine refit through vLLM's weight-sync calls before every step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engines.vllm_helpers import ENGINE_ENV, TINY_LLAMA, require_vllm
from tests.helpers import child_env

require_vllm()

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_example_run_file_trains_three_steps_on_vllm(tmp_path):
    from policyworker.testing import tiny_model_folder

    shape: dict[str, Any] = {k: v for k, v in TINY_LLAMA.items() if k != "vocab_size"}
    model = tiny_model_folder(
        tmp_path / "model", vocab=TINY_LLAMA["vocab_size"], tokenizer=True, **shape
    )
    overrides = [
        f"policy.model_name={model}",
        "generation.backend=vllm",
        "grpo.max_num_steps=3",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
    ]
    config = str(ROOT / "examples/grpo/run.yaml")
    run = subprocess.run(
        [sys.executable, "-m", "policyworker", "grpo", "--config", config, *overrides],
        cwd=tmp_path,
        env=child_env(ROOT, **ENGINE_ENV),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    start = rf"grpo: {re.escape(str(model))} on \w+, 16 prompts, generation backend vllm, 3 steps"
    assert re.search(start, run.stdout), output[-4000:]
    assert len(re.findall(r"^step \d/3  reward \d", run.stdout, re.M)) == 3, output[-4000:]
    logged = [json.loads(x) for x in (tmp_path / "logs/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert all(m["refit_ms"] > 0 for m in logged)  # a refit reached vLLM before every step
    assert (tmp_path / "ckpt/step_3/grpo_state.json").is_file()

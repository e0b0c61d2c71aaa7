"""In-flight refits on a GPU through bench/inflight.py's two processes (the trainer here, an HF
inference process decoding): the inference side serves them one-pass (the trainer writes the
spare arena over CUDA IPC, the swap copies it live between decode steps), and every sampled
token's logprob recomputed under its tagged version matches."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_inflight_refits_on_a_gpu_go_one_pass_and_tag_every_token_right(tmp_path):
    out = tmp_path / "inflight.json"
    cmd = [sys.executable, "-m", "bench.inflight", "--steps", "60", "--every", "20"]
    done = subprocess.run(
        [*cmd, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    settings = json.loads(out.read_text())["settings"]
    assert settings["inflight_swap_mode"] == "one_pass"
    check = settings["version_check"]
    assert check["wrong"] == 0 and len(check["versions"]) >= 3, check

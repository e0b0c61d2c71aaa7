"""MoE routing under gloo dp2 (FSDP2) == one process: replayed logprobs, the step's expert loads
summed over both ranks (fixed batching, and packing with a dummy microbatch on rank 1), and the
DeepSeek-V3 gate bias moved identically on every rank. One spawn runs every check."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.distributed import moe_workers
from tests.distributed.launch import run_on_gloo
from tests.helpers import tiny_deepseek_v3_config

pytestmark = pytest.mark.distributed


def test_moe_load_counting_and_replay_under_dp2_match_one_process(tmp_path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_v3_config())
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "ds")
    want = moe_workers.moe_reference(str(tmp_path / "ds"))
    run_on_gloo(moe_workers.moe_dp2, 2, str(tmp_path / "ds"), want)

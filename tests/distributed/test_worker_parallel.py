"""PolicyWorker under dp2, tp2 and dp2 x tp2 (gloo) == the same worker in one process.

Logprobs, top-k and the weights after two `train` calls (fp32, atol 1e-5), global loss per
call independent of the layout.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.distributed import workers
from tests.distributed.launch import run_on_gloo

pytestmark = pytest.mark.distributed

@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("worker_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_worker_dp2_and_tp2_match_one_process(llama_path):
    run_on_gloo(workers.worker_parity, 2, llama_path, (1, 2))


def test_worker_dp2_tp2_matches_one_process(llama_path):
    run_on_gloo(workers.worker_parity, 4, llama_path, (2,))

"""Tiny HF Llama / Qwen2 / Qwen3 under TP, FSDP2 (dp) and dp x tp on gloo == one process.

Logits, logprobs, the global loss, the pre-clip grad norm and the parameters after a few AdamW
steps with active clipping all match the single-process fp32 run (atol 1e-5).
"""

import time

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.distributed import workers
from tests.distributed.launch import run_on_gloo
from tests.helpers import TINY_DECODER_SHAPE

pytestmark = pytest.mark.distributed

_SHAPE = TINY_DECODER_SHAPE


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    torch.manual_seed(0)
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(**_SHAPE, tie_word_embeddings=False)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**_SHAPE, tie_word_embeddings=True)),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(**_SHAPE, head_dim=8, tie_word_embeddings=False)),
    }
    paths = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def test_two_ranks_tp2_and_dp2_match_single_process(model_paths):
    layouts = [
        (2, {}, ("llama", "qwen2", "qwen3")),  # tp2 (FSDP2 over dp=1)
        (1, {}, ("llama", "qwen2")),  # dp2: FSDP2
        (2, {"sequence_parallel": True}, ("llama",)),  # tp2 + sequence parallel
        (1, {"activation_checkpointing": True}, ("qwen2",)),  # dp2 + recompute
    ]
    run_on_gloo(workers.model_suite, 2, model_paths, layouts)


def test_four_ranks_dp2_tp2_match_single_process(model_paths):
    layouts = [(2, {}, ("llama", "qwen2"))]
    run_on_gloo(workers.model_suite, 4, model_paths, layouts)


def test_tp_that_does_not_divide_kv_heads_is_a_clear_error(model_paths):
    run_on_gloo(workers.tp_divisibility_error, 4, model_paths["llama"])


def test_a_rank_that_raises_ends_the_job_within_seconds():
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        run_on_gloo(workers.one_rank_raises, 2)
    assert time.monotonic() - start < 30

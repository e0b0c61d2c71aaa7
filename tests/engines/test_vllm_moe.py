"""Tiny MoE models (Qwen3-MoE, Mixtral) through a real vLLM engine each: the refit's per-expert
checkpoint names reach vLLM's fused-MoE layers, and vLLM then generates what HF generates with
the same weights. (Before the refit names followed save_pretrained, vLLM refused Mixtral's
stream: "no module or parameter named 'layers.0.mlp'".)"""

from __future__ import annotations

import pytest
import torch

from tests.engines.vllm_helpers import (
    PROMPTS,
    engine,
    generate,
    hf_continuation,
    require_vllm,
    tiny_model,
)

require_vllm()

from policyworker.demo.options import VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.shell.engines.vllm import VllmRefit  # noqa: E402
from policyworker.shell.refit.sender import RefitSender  # noqa: E402

pytestmark = pytest.mark.slow


def _qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
    )


def _mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
    )


@pytest.mark.parametrize(
    ("kind", "make_config", "expert_name"),
    [
        ("qwen3_moe", _qwen3_moe_config, ".mlp.experts.3.down_proj."),
        ("mixtral", _mixtral_config, ".block_sparse_moe.experts.3.w2."),
    ],
)
def test_moe_refit_reaches_vllms_experts(tmp_path, kind, make_config, expert_name):
    config = make_config()
    folder = str(tmp_path / kind)
    tiny_model(config, seed=0).save_pretrained(folder)
    trained = tiny_model(config, seed=31)  # other weights: only a complete refit can match HF
    sender = RefitSender(lambda: trained, torch.float32)
    assert any(expert_name in name for name in sender.prepare_refit_info())
    try:
        with engine(folder, in_process=True) as llm:  # no PolicyWorker here
            before = generate(llm, PROMPTS, max_tokens=6)
            assert VllmRefit(llm, sender).refit()["version"] == 1
            outs = generate(llm, PROMPTS, max_tokens=6)
    finally:
        sender.close()
    assert outs != before
    for prompt, (tokens, logprobs) in zip(PROMPTS, outs, strict=True):
        greedy, hf_lp = hf_continuation(trained, prompt, tokens)
        assert tokens == greedy
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(hf_lp), rtol=0, atol=VLLM_FP32_TOLERANCE
        )

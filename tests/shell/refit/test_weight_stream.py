"""The refit params stream: HF checkpoint names/values, dtypes, LoRA merge, metadata parity."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import (
    DeepseekV3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from policyworker.errors import LoRAMergeError
from policyworker.shell.refit.weight_stream import params_generator, refit_info
from policyworker.testing import tiny_model
from tests.helpers import router_weight_dtype, tiny_deepseek_v3_config, tiny_qwen3_moe_config

torch.manual_seed(0)


def _qwen3_moe():
    return Qwen3MoeForCausalLM(tiny_qwen3_moe_config())


def _deepseek_v3():
    cfg = tiny_deepseek_v3_config()
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a non-trivial router bias so a lost fp32 digit would show
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(
                    torch.randn_like(module.e_score_correction_bias) * 1e-3 + 1.0
                )
    return model


@pytest.mark.parametrize("build", [_qwen3_moe, _deepseek_v3], ids=["qwen3_moe", "deepseek_v3"])
def test_names_and_values_equal_what_save_pretrained_writes(build, tmp_path):
    model = build()
    model.save_pretrained(tmp_path)
    saved = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        saved.update(load_file(path))
    streamed = dict(params_generator(model, torch.float32))
    assert sorted(streamed) == sorted(saved)
    assert any(".experts.3.up_proj.weight" in n for n in streamed)
    for name, tensor in streamed.items():
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name
        assert tensor.is_contiguous()


def test_deepseek_router_state_stays_fp32_and_the_rest_is_cast():
    model = _deepseek_v3()
    streamed = dict(params_generator(model, torch.bfloat16))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert streamed[bias].dtype == torch.float32
    assert torch.equal(streamed[bias], model.model.layers[1].mlp.gate.e_score_correction_bias)
    assert streamed["model.layers.1.mlp.gate.weight"].dtype == router_weight_dtype(
        model, torch.bfloat16
    )  # whatever the installed transformers keeps in fp32
    assert streamed["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    info = refit_info(model, torch.bfloat16)
    assert list(info) == list(streamed)
    assert all(info[n] == (t.shape, t.dtype) for n, t in streamed.items())


def test_tied_lm_head_is_omitted_and_metadata_matches_the_stream():
    model = tiny_model("qwen2", layers=1)  # tied embeddings
    streamed = list(params_generator(model, torch.bfloat16))
    assert "lm_head.weight" not in dict(streamed) and streamed[0][0] == "model.embed_tokens.weight"
    assert refit_info(model, torch.bfloat16) == {n: (t.shape, t.dtype) for n, t in streamed}


def test_plain_linear_int_buffers_and_draft_prefix():
    base = nn.Linear(2, 1)
    base.register_buffer("token_map", torch.arange(6, dtype=torch.int64))
    draft = nn.Linear(2, 2, bias=False)
    streamed = list(params_generator(base, torch.bfloat16, draft))
    assert [n for n, _ in streamed] == ["weight", "bias", "token_map", "draft.weight"]
    assert [t.dtype for _, t in streamed] == [
        torch.bfloat16,
        torch.bfloat16,
        torch.int64,
        torch.bfloat16,
    ]
    assert torch.equal(streamed[2][1], torch.arange(6))
    streamed32 = list(params_generator(base, torch.float32))
    assert all(t.is_contiguous() for _, t in streamed32) and streamed32[0][1].dtype == torch.float32


class _LoRALinear(nn.Linear):
    """Duck-typed like shell/model/lora.py's LinearLoRA: lora_A [dim,in], lora_B [out,dim],
    scale."""

    def __init__(self, d_in, d_out, dim, scale):
        super().__init__(d_in, d_out)
        self.lora_A = nn.Linear(d_in, dim, bias=False)
        self.lora_B = nn.Linear(dim, d_out, bias=False)
        self.scale = scale


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = _LoRALinear(6, 5, 2, 4.0)
        self.norm = nn.LayerNorm(5)


def test_lora_is_merged_and_adapters_are_never_sent():
    block = _Block()
    nn.init.normal_(block.q_proj.lora_B.weight)
    streamed = dict(params_generator(block, torch.float32))
    assert sorted(streamed) == ["norm.bias", "norm.weight", "q_proj.bias", "q_proj.weight"]
    q = block.q_proj
    expected = q.weight + 4.0 * (q.lora_B.weight @ q.lora_A.weight)
    torch.testing.assert_close(streamed["q_proj.weight"], expected)
    assert not torch.equal(streamed["q_proj.weight"], q.weight)  # the live model is not modified
    assert refit_info(block, torch.float32)["q_proj.weight"] == (torch.Size([5, 6]), torch.float32)


class _Unreachable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lora_A = nn.Linear(3, 2, bias=False)
        self.lora_B = nn.Linear(2, 3, bias=False)
        self.scale = 1.0
        self.base = nn.Parameter(torch.zeros(3, 3))  # its weight is not "<module>.weight"


def test_unreachable_lora_module_fails_before_the_first_tensor():
    model = nn.Module()
    model.attn = _Unreachable()
    stream = params_generator(model, torch.float32)
    with pytest.raises(LoRAMergeError, match="'attn'"):
        next(stream)


def test_refit_stream_reuses_its_compiled_walk_until_the_signature_changes():
    from policyworker.shell.refit.weight_stream import refit_stream

    block = _Block()
    first = refit_stream(block, torch.bfloat16)
    again = refit_stream(block, torch.bfloat16)
    assert again.specs is first.specs and again.key == first.key
    assert refit_stream(block, torch.float16).key != first.key  # another target dtype: its own walk
    with torch.no_grad():
        block.q_proj.scale = 2.0  # read live at every refit, not compiled in
        nn.init.normal_(block.q_proj.lora_B.weight)
    merged = dict((s.name, s.tensor) for s in refit_stream(block, torch.float32).sources)
    q = block.q_proj
    torch.testing.assert_close(
        merged["q_proj.weight"], q.weight + 2.0 * (q.lora_B.weight @ q.lora_A.weight)
    )
    block.norm = nn.LayerNorm(7)  # a new shape: the walk is compiled again
    changed = refit_stream(block, torch.bfloat16)
    assert changed.key != first.key and dict((s.name, s.shape) for s in changed.specs)[
        "norm.weight"
    ] == (7,)
    assert [s.name for s in changed.specs] == list(refit_info(block, torch.bfloat16))

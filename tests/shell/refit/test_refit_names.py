"""Refit names equal the checkpoint for every supported architecture.

For each model_type in SUPPORTED_MODEL_TYPES, a tiny random model (built from its config, no
download): what the refit announces (``RefitSender.prepare_refit_info``, the worker's) and
streams (``params_generator``) equals, name by name, the shapes, dtypes and values
``save_pretrained`` writes; and ``from_pretrained`` of the streamed tensors loads without a
missing or unexpected key and gives the trainer's fp32 logprobs. The consolidated HF
checkpoint writer uses the same layout.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from policyworker.errors import UnsupportedModelError
from policyworker.shell.checkpoint.safetensors_io import model_hf_layout
from policyworker.shell.refit.hf_names import SUPPORTED_MODEL_TYPES
from policyworker.shell.refit.sender import RefitSender
from policyworker.shell.refit.weight_stream import params_generator
from tests.helpers import router_weight_dtype
from tests.shell.conftest import make_config

_SHAPE = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
_MOE = dict(num_experts_per_tok=2)


def tiny_config(model_type: str) -> transformers.PretrainedConfig:
    """A 2-layer model of `model_type` with hidden size 16 (MoE: 4 experts, top 2)."""
    T = transformers
    if model_type == "deepseek_v3":
        return T.DeepseekV3Config(
            **{**_SHAPE, "num_key_value_heads": 2},
            **_MOE,
            moe_intermediate_size=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
        )
    builders = {
        "llama": lambda: T.LlamaConfig(**_SHAPE, tie_word_embeddings=False),
        "qwen2": lambda: T.Qwen2Config(**_SHAPE, tie_word_embeddings=True),
        "qwen3": lambda: T.Qwen3Config(**_SHAPE, head_dim=8),
        "mistral": lambda: T.MistralConfig(**_SHAPE),
        "gemma2": lambda: T.Gemma2Config(**_SHAPE, head_dim=8),
        "gemma3_text": lambda: T.Gemma3TextConfig(**_SHAPE, head_dim=8),
        "phi3": lambda: T.Phi3Config(**_SHAPE, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            **_SHAPE, **_MOE, head_dim=8, moe_intermediate_size=8, num_experts=4
        ),
        "mixtral": lambda: T.MixtralConfig(**_SHAPE, **_MOE, num_local_experts=4),
        "gpt_oss": lambda: T.GptOssConfig(**_SHAPE, **_MOE, head_dim=8, num_local_experts=4),
    }
    return builders[model_type]()


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 eval-mode model of `model_type` whose every weight is non-trivial."""
    config = tiny_config(model_type)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # zero-initialised biases/sinks would hide a misplaced tensor
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def saved_tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return out


def logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1)


def refit_table_row(model_type: str, folder) -> dict:
    """Stream vs save_pretrained of one architecture; logprobs of from_pretrained(stream)."""
    model = tiny_model(model_type)
    (folder / "saved").mkdir()
    model.save_pretrained(folder / "saved")
    saved = saved_tensors(folder / "saved")
    info = RefitSender(lambda: model, torch.float32).prepare_refit_info()
    streamed = dict(params_generator(model, torch.float32))
    # from_pretrained of exactly what was streamed (config only from the model, weights from us)
    (folder / "stream").mkdir()
    model.config.save_pretrained(folder / "stream")
    save_file(
        {n: t.clone() for n, t in streamed.items()}, str(folder / "stream" / "model.safetensors")
    )
    loaded, loading = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "stream",
        dtype=torch.float32,
        attn_implementation="eager",
        output_loading_info=True,
    )
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
    delta = (logprobs(loaded.eval(), ids) - logprobs(model, ids)).abs().max().item()
    # a model loaded by from_pretrained converts with the mapping it was loaded with
    reloaded_info = RefitSender(lambda: loaded, torch.float32).prepare_refit_info()
    return {
        "model": model,
        "saved": saved,
        "info": info,
        "streamed": streamed,
        "delta": delta,
        "reloaded_info": reloaded_info,
        "problems": {
            k: sorted(v)
            for k, v in loading.items()
            if k in ("missing_keys", "unexpected_keys") and v
        },
    }


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_stream_equals_save_pretrained_and_reloads_to_the_same_logprobs(model_type, tmp_path):
    row = refit_table_row(model_type, tmp_path)
    saved, info, streamed = row["saved"], row["info"], row["streamed"]
    assert list(info) == list(streamed)  # the announcement is the stream, in order
    assert {n: (tuple(s), d) for n, (s, d) in info.items()} == {
        n: (tuple(t.shape), t.dtype) for n, t in saved.items()
    }
    for name, tensor in streamed.items():
        assert torch.equal(tensor, saved[name]), name
    assert row["problems"] == {}
    assert row["reloaded_info"] == info
    assert row["delta"] <= 1e-6, row["delta"]


def test_mixtral_and_gpt_oss_stream_their_checkpoint_layout(tmp_path):
    """The two layouts the hard-coded per-expert split got wrong."""
    mixtral = dict(params_generator(tiny_model("mixtral"), torch.float32))
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in mixtral
    assert "model.layers.0.block_sparse_moe.gate.weight" in mixtral
    assert not any(".mlp." in n for n in mixtral)
    gpt_oss = dict(params_generator(tiny_model("gpt_oss"), torch.float32))
    assert len(gpt_oss) == 37  # fused experts stay fused: that is GPT-OSS's checkpoint layout
    assert gpt_oss["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 16, 64)


def test_the_stream_is_views_of_the_live_weights_for_fused_experts():
    model = tiny_model("mixtral")
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    streamed = dict(params_generator(model, torch.float32))
    w3 = streamed["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    assert torch.equal(w3, fused[2, 32:])  # up half of expert 2 (gate rows first)
    assert w3.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def test_bf16_refit_keeps_the_models_fp32_modules_under_renamed_names():
    model = tiny_model("deepseek_v3")
    info = RefitSender(lambda: model, torch.bfloat16).prepare_refit_info()
    assert info["model.layers.1.mlp.gate.e_score_correction_bias"][1] == torch.float32
    router = router_weight_dtype(model, torch.bfloat16)
    assert info["model.layers.1.mlp.gate.weight"][1] == router
    assert info["model.layers.1.mlp.experts.0.gate_proj.weight"][1] == torch.bfloat16


def test_an_unsupported_model_type_is_refused_by_name_before_streaming():
    config = transformers.OlmoConfig(**_SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config)
    sender = RefitSender(lambda: model, torch.float32)
    refusal = r"model_type 'olmo'.*'mixtral'.*SUPPORTED_MODEL_TYPES"
    with pytest.raises(UnsupportedModelError, match=refusal):
        sender.prepare_refit_info()
    with pytest.raises(ValueError, match="model_type 'olmo'"):
        next(params_generator(model, torch.float32))


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_worker_falls_back_to_eager_once_and_announces_the_checkpoint(model_type, tmp_path, caplog):
    """The default attention ('auto' = sdpa) cannot build Gemma2 / GPT-OSS: the worker uses eager,
    says so once, and its prepare_refit_info is what save_pretrained writes."""
    from policyworker.shell.model import hf_model as model_module
    from policyworker.shell.worker.policy_worker import PolicyWorker

    model = tiny_model(model_type)
    model.save_pretrained(tmp_path / "m")
    # transformers 5.19 gives Gemma2 sdpa, 5.2x does not; GPT-OSS has none in either
    has_sdpa = bool(type(model)._supports_sdpa)
    model_module._EAGER_FALLBACK_LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="policyworker"):
        workers = [PolicyWorker(make_config(str(tmp_path / "m"))) for _ in range(2)]
    fallbacks = [r for r in caplog.records if "has no sdpa attention" in r.getMessage()]
    assert len(fallbacks) == (0 if has_sdpa else 1)
    assert all(r.name == "policyworker" for r in fallbacks)
    expected = "sdpa" if has_sdpa else "eager"
    assert workers[0].model.config._attn_implementation == expected
    workers[0].model.save_pretrained(tmp_path / "again")
    saved = saved_tensors(tmp_path / "again")
    info = workers[0].prepare_refit_info()
    assert {n: tuple(s) for n, (s, _) in info.items()} == {
        n: tuple(t.shape) for n, t in saved.items()
    }
    for worker in workers:
        worker.shutdown()


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_the_consolidated_hf_checkpoint_has_save_pretrained_names(model_type):
    model = tiny_model(model_type)
    specs = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    written = {t.name: t.shape for t in model_hf_layout(model, specs)}
    announced = RefitSender(lambda: model, torch.float32).prepare_refit_info()
    assert written == {n: tuple(s) for n, (s, _) in announced.items()}


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_a_worker_checkpoint_loads_with_from_pretrained(model_type, tmp_path):
    from policyworker.shell.worker.policy_worker import PolicyWorker

    tiny_model(model_type).save_pretrained(tmp_path / "m")
    worker = PolicyWorker(make_config(str(tmp_path / "m")))
    with torch.no_grad():  # weights that differ from the initial folder's
        for param in worker.model.parameters():
            param.mul_(1.5)
    worker.save_checkpoint(str(tmp_path / "ck"), is_final_checkpoint=True)
    loaded, loading = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ck" / "model",
        dtype=torch.float32,
        attn_implementation=worker.model.config._attn_implementation,
        output_loading_info=True,
    )
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logprobs(loaded.eval(), ids), logprobs(worker.model.eval(), ids))
    worker.shutdown()


def test_explicit_sdpa_for_a_model_without_it_names_the_setting(tmp_path):
    from policyworker.shell.worker.policy_worker import PolicyWorker

    # GPT-OSS has no sdpa path in any supported transformers (Gemma2 has one in 5.19)
    tiny_model("gpt_oss").save_pretrained(tmp_path / "m")
    cfg = make_config(str(tmp_path / "m"), dtensor_cfg={"attn_implementation": "sdpa"})
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa'.*GptOssForCausalLM.*'eager'"):
        PolicyWorker(cfg)


if __name__ == "__main__":  # the architecture table of the closing note
    import pathlib
    import tempfile

    print("| arch | tensors streamed | == save_pretrained | max abs d logprob |")
    print("|---|---|---|---|")
    for model_type in SUPPORTED_MODEL_TYPES:
        row = refit_table_row(model_type, pathlib.Path(tempfile.mkdtemp()))
        same = {n: (tuple(s), d) for n, (s, d) in row["info"].items()} == {
            n: (tuple(t.shape), t.dtype) for n, t in row["saved"].items()
        } and all(torch.equal(t, row["saved"][n]) for n, t in row["streamed"].items())
        print(f"| {model_type} | {len(row['streamed'])} | {same} | {row['delta']:.1e} |")
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}))

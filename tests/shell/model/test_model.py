"""Model loading, attention selection and the document-safe packed kernels (CPU)."""

import pytest
import torch

from policyworker.config import load_config
from policyworker.shell.model import attention
from policyworker.shell.model.hf_model import (
    check_document_isolation,
    forward_logits,
    load_policy_model,
    resolve_attn_implementation,
    set_training_mode,
)
from tests.shell.conftest import make_config

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("requested", "packing", "device", "precision", "expected"),
    [
        ("auto", False, CPU, torch.float32, "sdpa"),
        ("auto", True, CPU, torch.bfloat16, "sdpa"),
        ("auto", True, CUDA, torch.bfloat16, attention.VARLEN_ATTN_NAME),
        ("auto", True, CUDA, torch.float32, "sdpa"),
        ("auto", False, CUDA, torch.bfloat16, "sdpa"),
        ("varlen", False, CUDA, torch.float16, attention.VARLEN_ATTN_NAME),
        ("eager", True, CPU, torch.float32, "eager"),
        ("flex_attention", True, CPU, torch.float32, "flex_attention"),
    ],
)
def test_attention_selection(requested, packing, device, precision, expected):
    assert (
        resolve_attn_implementation(requested, packing=packing, device=device, precision=precision)
        == expected
    )


@pytest.mark.parametrize(
    ("requested", "device", "precision", "match"),
    [
        ("varlen", CPU, torch.bfloat16, "needs CUDA"),
        ("varlen", CUDA, torch.float32, "bfloat16 or float16"),
        ("flash_attention_2", CPU, torch.float32, "not supported"),
    ],
)
def test_impossible_attention_is_a_value_error(requested, device, precision, match):
    with pytest.raises(ValueError, match=match):
        resolve_attn_implementation(requested, packing=True, device=device, precision=precision)


def test_load_without_tokenizer_keeps_fp32_master_weights_and_tied_embeddings(tiny_model_paths):
    cfg = load_config(
        make_config(
            tiny_model_paths["qwen2"],
            precision="bfloat16",
            hf_config_overrides={"rms_norm_eps": 1e-5},
        )
    )
    model, tokenizer = load_policy_model(cfg, device=CPU)
    assert tokenizer is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.use_cache is False and model.config.rms_norm_eps == 1e-5
    # the checkpoint has no pad id and none is invented: no embedding row is frozen
    assert model.config.pad_token_id is None and model.model.embed_tokens.padding_idx is None
    assert model.config._attn_implementation == "sdpa"


def test_load_with_tokenizer_pads_with_eos_on_the_tokenizer_only_and_checkpoints_activations(
    tiny_tokenizer_model_path,
):
    cfg = load_config(
        make_config(tiny_tokenizer_model_path, dtensor_cfg={"activation_checkpointing": True})
    )
    model, tokenizer = load_policy_model(cfg, device=CPU)
    assert tokenizer is not None and tokenizer.pad_token == "t1"
    assert tokenizer.pad_token_id == 1 and model.config.pad_token_id is None
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    model.train()
    ids = torch.randint(3, 128, (2, 6))
    loss = forward_logits(model, ids, position_ids=torch.arange(6).expand(2, -1)).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("impl", ["sdpa", "eager", attention.VARLEN_ATTN_NAME])
def test_packed_forward_isolates_documents(tiny_model_paths, impl):
    """[a | b] packed with restarted position_ids gives the logits of a and b run alone."""
    import transformers

    name = attention.ensure_varlen_registered() if impl == attention.VARLEN_ATTN_NAME else impl
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_paths["llama"], dtype=torch.float32, attn_implementation=name
    ).eval()
    model.config.use_cache = False
    a, b = torch.randint(3, 128, (1, 5)), torch.randint(3, 128, (1, 7))
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = forward_logits(
            model,
            torch.cat([a, b], 1),
            position_ids=pos,
            cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32),
            max_seqlen=7,
        )
        alone_a = forward_logits(model, a, position_ids=torch.arange(5)[None])
        alone_b = forward_logits(model, b, position_ids=torch.arange(7)[None])
    torch.testing.assert_close(packed[:, :5], alone_a)
    torch.testing.assert_close(packed[:, 5:], alone_b)
    check_document_isolation(model, autocast_dtype=torch.float32)


@pytest.mark.parametrize("impl", ["sdpa", attention.VARLEN_ATTN_NAME])
def test_padded_rows_without_position_ids_are_each_row_alone(tiny_model_paths, impl):
    """A right-padded microbatch runs on the model's own positions (one row of them for the
    whole batch): every row's logits are those of the row run alone, up to its length."""
    import transformers

    name = attention.ensure_varlen_registered() if impl == attention.VARLEN_ATTN_NAME else impl
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_paths["llama"], dtype=torch.float32, attn_implementation=name
    ).eval()
    rows = torch.randint(3, 128, (3, 6))
    with torch.no_grad():
        batch = forward_logits(model, rows, position_ids=None)
        for r in range(3):
            alone = forward_logits(model, rows[r : r + 1, : 4 + r % 3], position_ids=None)
            torch.testing.assert_close(batch[r : r + 1, : 4 + r % 3], alone)


def test_isolation_probe_rejects_a_kernel_that_attends_across_documents(tiny_model_paths):
    import transformers
    from transformers import AttentionInterface

    def leaky(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("test_leaky_attention", leaky)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_paths["llama"], dtype=torch.float32, attn_implementation="test_leaky_attention"
    )
    with pytest.raises(ValueError, match="attend to each other"):
        check_document_isolation(model, autocast_dtype=torch.float32)


def test_cu_seqlens_from_position_ids():
    cu, max_len = attention.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert cu.tolist() == [0, 3, 5, 6] and cu.dtype == torch.int32 and max_len == 3
    cu, max_len = attention.cu_seqlens_from_position_ids(torch.tensor([[0, 1], [0, 1]]))
    assert cu.tolist() == [0, 2, 4] and max_len == 2


def test_varlen_registration_is_idempotent_and_lazy():
    from transformers import AttentionInterface

    assert attention.ensure_varlen_registered() == attention.ensure_varlen_registered()
    assert AttentionInterface._global_mapping[attention.VARLEN_ATTN_NAME] is (
        attention.varlen_attention_forward
    )
    assert not attention.varlen_kernel_available(CPU)


def test_reward_models_load_with_one_label(tiny_reward_paths):
    for kind, cls_name in (
        ("bradley_terry", "LlamaForSequenceClassification"),
        ("regression", "LlamaForTokenClassification"),
    ):
        cfg = load_config(
            make_config(tiny_reward_paths[kind], reward_model_cfg={"reward_model_type": kind})
        )
        model, _ = load_policy_model(cfg, device=CPU)
        assert type(model).__name__ == cls_name and model.config.num_labels == 1


class _CountingTrain(torch.nn.Linear):
    """A module whose class overrides ``train`` (counts its calls)."""

    calls = 0

    def train(self, mode: bool = True):
        type(self).calls += 1
        return super().train(mode)


def test_set_training_mode_switches_every_module_and_skips_only_a_call_that_changes_nothing(
    tiny_model_paths, monkeypatch
):
    """The skip is sound: any module (however deep) in the other mode, or a module overriding
    ``train``, gets the real call; a model wholly in the mode does not."""
    model, _ = load_policy_model(load_config(make_config(tiny_model_paths["qwen2"])), device=CPU)
    calls = []
    real_train = torch.nn.Module.train
    monkeypatch.setattr(
        torch.nn.Module,
        "train",
        lambda self, mode=True: calls.append(mode) or real_train(self, mode),
    )
    set_training_mode(model, False)
    assert not any(m.training for m in model.modules())
    calls.clear()
    set_training_mode(model, False)
    assert calls == []  # already in eval mode everywhere: no walk through __setattr__
    deepest = list(model.modules())[-1]
    deepest.training = True  # one leaf left in train mode: the call must reach it
    set_training_mode(model, False)
    assert calls and not any(m.training for m in model.modules())
    set_training_mode(model, True)
    assert all(m.training for m in model.modules())
    model.model.layers[0].mlp.add_module("counted", _CountingTrain(2, 2))
    model.model.layers[0].mlp.counted.train(True)
    _CountingTrain.calls = 0
    set_training_mode(model, True)  # the mode is unchanged, but an override always gets its call
    assert _CountingTrain.calls == 1

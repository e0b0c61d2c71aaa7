"""policyworker.testing: the one builder of random HF models for tests, benches and examples."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.testing import (
    ARCHITECTURES,
    TINY_SHAPE,
    tiny_config,
    tiny_model,
    tiny_model_folder,
)


@settings(max_examples=25, deadline=None)
@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    vocab=st.integers(1, 4096),
    layers=st.none() | st.integers(1, 6),
    hidden=st.none() | st.sampled_from([16, 64]),
)
def test_config_has_the_asked_shape_and_the_tiny_defaults_elsewhere(arch, vocab, layers, hidden):
    extra = {} if hidden is None else {"hidden_size": hidden}
    cfg = tiny_config(arch, vocab=vocab, layers=layers, **extra)
    assert cfg.model_type == arch and cfg.vocab_size == vocab
    assert cfg.num_hidden_layers == (TINY_SHAPE["num_hidden_layers"] if layers is None else layers)
    assert cfg.hidden_size == (TINY_SHAPE["hidden_size"] if hidden is None else hidden)
    assert cfg.num_attention_heads == TINY_SHAPE["num_attention_heads"]


@pytest.mark.parametrize(
    ("arguments", "words"),
    [({"arch": "gpt9"}, ["arch='gpt9'", "llama"]), ({"vocab": 0}, ["vocab=0", "at least 1"])],
)
def test_bad_arguments_name_the_key_and_the_fix(arguments, words):
    with pytest.raises(ValueError) as info:
        tiny_config(**arguments)
    assert all(w in str(info.value) for w in words)


def test_same_seed_same_bits_another_seed_other_bits_and_init_std_scales():
    a, b = tiny_model("qwen2", seed=3), tiny_model("qwen2", seed=3)
    c = tiny_model("qwen2", seed=4)
    wide = tiny_model("qwen2", seed=3, init_std=0.2)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), name
        if p.ndim == 2:
            assert not torch.equal(p, r), name
    std = wide.get_parameter("model.layers.0.mlp.up_proj.weight").std().item()
    assert 0.15 < std < 0.25


def test_folder_reloads_to_the_same_model_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_folder(tmp_path / "m", "llama", vocab=64, layers=1, seed=5, tokenizer=True)
    again = AutoModelForCausalLM.from_pretrained(path)
    built = tiny_model("llama", vocab=64, layers=1, seed=5)
    assert again.config.num_hidden_layers == 1 and again.config.vocab_size == 64
    for (name, p), q in zip(built.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids(["t5", "t7", "t63"]) == [5, 7, 63]
    assert tok.eos_token == "t1" and tok.convert_tokens_to_ids("nope") == 0
    assert tok("t5 t7  t63")["input_ids"] == [5, 7, 63]
    assert tok.decode([5, 7, 63]) == "t5 t7 t63"

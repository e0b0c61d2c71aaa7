"""Properties of parameter-name handling: wrappers, LoRA names, MoE expert split/fuse."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.names import (
    canonical_name,
    drop_tied_lm_head,
    expert_slot,
    fuse_expert_tensors,
    is_lora_param,
    lora_base_name,
    lora_module_name,
    to_hf_tensors,
)
from tests.property.strategies import SEEDS, seeded_randn

segments = st.sampled_from(
    ["model", "layers", "0", "3", "self_attn", "q_proj", "mlp", "embed_tokens", "norm"]
)
dotted = st.lists(segments, min_size=1, max_size=5).map(".".join)
wrappers = st.sampled_from(["_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."])


@given(
    parts=st.lists(st.tuples(segments, st.lists(wrappers, max_size=2)), min_size=1, max_size=5),
    leading_module=st.booleans(),
)
def test_canonical_name_removes_every_wrapper_fragment_and_nothing_else(parts, leading_module):
    clean = ".".join(seg for seg, _ in parts)
    wrapped = ".".join("".join(ws) + seg for seg, ws in parts)
    if leading_module:
        wrapped = "module." + wrapped
    assert canonical_name(wrapped) == clean
    assert canonical_name(clean) == clean  # idempotent on clean names


@given(module=dotted, ab=st.sampled_from(["lora_A", "lora_B"]))
def test_lora_names_map_to_their_module_and_base_weight(module, ab):
    name = f"{module}.{ab}.weight"
    assert is_lora_param(name)
    assert lora_module_name(name) == module
    assert lora_base_name(name) == f"{module}.weight"
    assert not is_lora_param(f"{module}.weight")


def test_lora_module_name_rejects_plain_names():
    with pytest.raises(ValueError, match="not a LoRA adapter name"):
        lora_module_name("model.layers.0.q_proj.weight")


@given(
    E=st.integers(1, 4),
    I=st.integers(1, 5),
    H=st.integers(1, 5),
    layer=st.integers(0, 30),
    seed=SEEDS,
)
def test_split_then_fuse_experts_is_identity(E, I, H, layer, seed):
    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up = seeded_randn(seed, (E, 2 * I, H))
    down = seeded_randn(seed + 1, (E, H, I))
    bias = seeded_randn(seed + 2, (E,))
    source = [
        (f"{prefix}.gate_up_proj", gate_up),
        (f"model.layers.{layer}.mlp.gate.e_score_correction_bias", bias),
        (f"{prefix}.down_proj", down),
    ]
    split = [pair for name, t in source for pair in to_hf_tensors(name, t)]
    assert len(split) == 3 * E + 1
    for name, t in split:  # each split tensor is the slot's view of the fused tensor
        slot = expert_slot(name)
        if slot is not None:
            assert torch.equal(slot.view_of(dict(source)[slot.fused_name]), t)
    fused = fuse_expert_tensors(split)
    assert [n for n, _ in fused] == [n for n, _ in source]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fused, source))


@given(E=st.integers(1, 3), I=st.integers(1, 4), H=st.integers(1, 4), seed=SEEDS)
def test_gate_is_the_first_half_of_dim_one(E, I, H, seed):
    gate_up = seeded_randn(seed, (E, 2 * I, H))
    pieces = dict(to_hf_tensors("experts.gate_up_proj", gate_up))
    for e in range(E):
        assert torch.equal(pieces[f"experts.{e}.gate_proj.weight"], gate_up[e, :I])
        assert torch.equal(pieces[f"experts.{e}.up_proj.weight"], gate_up[e, I:])


def test_non_expert_names_pass_through():
    t = torch.zeros(2, 3)
    for name in [
        "model.layers.0.mlp.shared_experts.gate_proj.weight",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
    ]:
        assert to_hf_tensors(name, t) == [(name, t)]
        assert expert_slot(name) is None
    assert to_hf_tensors("m.experts.gate_up_proj", torch.zeros(2, 4, 3), split_fused_experts=False)[
        0
    ][0] == ("m.experts.gate_up_proj")


def test_fuse_rejects_incomplete_experts():
    pairs = [
        ("m.experts.0.gate_proj.weight", torch.zeros(1, 2)),
        ("m.experts.1.gate_proj.weight", torch.zeros(1, 2)),
        ("m.experts.1.up_proj.weight", torch.zeros(1, 2)),
    ]
    with pytest.raises(ValueError, match=r"missing per-expert tensors \['0.up_proj'\]"):
        fuse_expert_tensors(pairs)
    with pytest.raises(ValueError, match="appears twice"):
        fuse_expert_tensors(pairs[:1] * 2)


@given(names=st.lists(dotted, max_size=6), tied=st.booleans(), position=st.integers(0, 6))
def test_drop_tied_lm_head_removes_only_lm_head_and_only_when_tied(names, tied, position):
    names = [n for n in names if n != "lm_head.weight"]
    with_head = names[:position] + ["lm_head.weight"] + names[position:]
    out = drop_tied_lm_head(with_head, tie_word_embeddings=tied)
    assert out == (names if tied else with_head)

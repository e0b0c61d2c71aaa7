"""The planner's activation coefficients against what autograd really saves: a
``saved_tensors_hooks`` census of one Qwen2 decoder layer under bf16 autocast over fp32 weights,
eager and compiled whole by inductor (as ``fusion: layer`` runs it), on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from policyworker.functional.memory_plan import MemoryKnobs, activation_bytes_per_token_layer
from policyworker.shell.worker.memory_calls import shape_from_hf_config

# a tiny Qwen2 whose SDPA calls take the same CPU backend as the 1.5B shape's
CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 128,
}
TOKENS = 40  # no activation has a weight's shape (or its transpose): casts are told apart by it


def _census(compiled: bool) -> int:
    """Bytes per token the second decoder layer saves for the backward (weights, their casts
    and tensors an earlier layer saved excluded)."""
    torch.manual_seed(0)
    config = Qwen2Config(**CONFIG, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).float()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    weight_shapes |= {tuple(reversed(shape)) for shape in weight_shapes}  # transposed casts
    if compiled:
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, dynamic=False)
    where = {"layer": -1}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: where.update(layer=i))
    model.model.norm.register_forward_pre_hook(lambda *_: where.update(layer=-1))
    seen: dict[int, tuple[int, int]] = {}  # storage -> (layer that saved it first, bytes)

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        is_weight = ptr in params or tuple(t.shape) in weight_shapes
        if not is_weight and ptr not in seen:
            seen[ptr] = (where["layer"], t.untyped_storage().nbytes())
        return t

    ids = torch.randint(0, 128, (1, TOKENS))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        logits = model(input_ids=ids, use_cache=False).logits
    logits.float().sum().backward()
    return sum(nbytes for layer, nbytes in seen.values() if layer == 1) // TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_activation_coefficients_match_a_census_of_saved_tensors(compiled):
    shape = shape_from_hf_config(Qwen2Config(**CONFIG))
    knobs = MemoryKnobs(train_mb_tokens=TOKENS, logprob_mb_tokens=TOKENS, compiled_layers=compiled)
    planned = activation_bytes_per_token_layer(shape, knobs)
    measured = _census(compiled)
    # what the planner leaves out: the norms' per-token rstd and the attention's logsumexp, and
    # in eager layers SDPA's CPU math backend output apart from o_proj's input (one h in bf16)
    small = 4 * (2 + CONFIG["num_attention_heads"]) + (0 if compiled else 2 * shape.hidden)
    assert planned <= measured <= planned + small, (planned, measured)

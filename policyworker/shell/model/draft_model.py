"""The Eagle3 draft model itself: its layers, its config shaped like the policy's, the
Hugging Face Eagle3 config.json that vLLM loads as a speculative model, and reading one back.
Training it beside the policy is `shell/worker/draft.py`.

Layer numbering: vLLM's `eagle_aux_hidden_state_layer_ids` number an aux hidden state by the
decoder layer it enters (id k = the output of layer k - 1); `aux_layer_indices` (ours, and
NeMo-RL's) by the layer it leaves. A config.json names the ids at its top level (vLLM's loader,
published Eagle3 checkpoints), under `eagle_config` (what `eagle3_config` writes), or not at all
(vLLM then reads its default layers of the policy).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "AUX_IDS_KEY",
    "Eagle3Draft",
    "default_aux_layers",
    "eagle3_aux_layer_ids",
    "eagle3_config",
    "read_eagle3_config",
    "vllm_default_aux_ids",
]

AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """NeMo-RL's early/middle/late pick of policy layers (those that exist; layer 0 at least)."""
    picks = {1, max(0, num_layers // 2 - 1), max(1, num_layers - 4)}
    return tuple(sorted({i for i in picks if i < num_layers} or {0}))


class _FirstLayer(nn.Module):
    """Eagle3's first draft layer: attention over [norm(embedding), norm(hidden)]."""

    def __init__(self, config: Any) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaMLP,
            LlamaRMSNorm,
        )

        super().__init__()
        wide = LlamaConfig(
            **{
                **config.to_dict(),
                "hidden_size": 2 * config.hidden_size,
                "head_dim": config.head_dim,
            }
        )
        wide._attn_implementation = "sdpa"
        inner = LlamaDecoderLayer(wide, layer_idx=0)
        self.self_attn = inner.self_attn
        self.self_attn.o_proj = nn.Linear(
            config.num_attention_heads * config.head_dim, config.hidden_size, bias=False
        )
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, position_embeddings: Any
    ) -> torch.Tensor:
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, _ = self.self_attn(
            hidden_states=both, position_embeddings=position_embeddings, attention_mask=None
        )
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """fc (aux hidden states -> H), Eagle3 layers, final norm, LM head over the policy's vocab."""

    def __init__(self, config: Any, *, num_aux: int) -> None:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        super().__init__()
        config._attn_implementation = "sdpa"  # causal without a mask
        self.config = config
        self.num_aux = num_aux
        hidden = config.hidden_size
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            [_FirstLayer(config)]
            + [LlamaDecoderLayer(config, layer_idx=i) for i in range(1, config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, aux_hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, V] from fused aux hidden states [b, s, A*H] and embeddings [b, s, H]."""
        hidden = self.fc(aux_hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rope = self.rotary_emb(hidden, positions)
        hidden = self.layers[0](hidden, embeds, rope)
        for layer in self.layers[1:]:
            hidden = layer(hidden, position_embeddings=rope, position_ids=positions)
        return self.lm_head(self.norm(hidden))


def _draft_config(policy_config: Any, num_layers: int) -> Any:
    """A Llama config shaped like the policy (hidden, heads, vocab), `num_layers` deep."""
    from transformers import LlamaConfig

    heads = policy_config.num_attention_heads
    head_dim = getattr(policy_config, "head_dim", None) or policy_config.hidden_size // heads
    return LlamaConfig(
        hidden_size=policy_config.hidden_size,
        intermediate_size=policy_config.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(policy_config, "num_key_value_heads", heads),
        head_dim=head_dim,
        vocab_size=policy_config.vocab_size,
        num_hidden_layers=num_layers,
        rms_norm_eps=getattr(policy_config, "rms_norm_eps", 1e-6),
        max_position_embeddings=policy_config.max_position_embeddings,
        tie_word_embeddings=False,
    )


def eagle3_config(draft: Eagle3Draft, aux_layers: tuple[int, ...]) -> dict[str, Any]:
    """The draft's config.json: a Hugging Face Eagle3 draft config that vLLM loads as a
    speculative model (`speculative_config={"method": "eagle3", "model": folder}`).

    vLLM numbers its aux hidden states by the layer they enter (id k = the output of decoder
    layer k - 1); `aux_layer_indices` numbers the layer they leave, hence the + 1.
    """
    config = draft.config.to_dict()
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux_layers],
            "use_aux_hidden_state": True,
        },
        target_hidden_size=draft.config.hidden_size,
        draft_vocab_size=draft.config.vocab_size,
        aux_layer_indices=list(aux_layers),
    )
    return config


def vllm_default_aux_ids(num_layers: int) -> tuple[int, ...]:
    """The aux layer ids vLLM reads when a draft's config names none (its Eagle3 models'
    `get_eagle3_default_aux_hidden_state_layers`): early, middle and late."""
    return (2, num_layers // 2, num_layers - 3)


def eagle3_aux_layer_ids(
    meta: Mapping[str, Any], *, num_policy_layers: int, source: str
) -> tuple[int, ...]:
    """vLLM's aux layer ids of an Eagle3 draft config (`source` names the file in errors): the
    top-level key, the one under `eagle_config`, or vLLM's default for the policy's layers.
    Anything else (both keys disagreeing, not a list of distinct ints in 1..num_policy_layers)
    is a ValueError naming the key."""
    nested_config = meta.get("eagle_config")
    if nested_config is not None and not isinstance(nested_config, Mapping):
        msg = (
            f"{source}: 'eagle_config' must be a mapping, got {type(nested_config).__name__} "
            f"{nested_config!r}; write {{{AUX_IDS_KEY!r}: [...]}} there, or remove it"
        )
        raise ValueError(msg)
    top = meta.get(AUX_IDS_KEY)
    nested = None if nested_config is None else nested_config.get(AUX_IDS_KEY)
    if top is not None and nested is not None and list(top) != list(nested):
        msg = (
            f"{source}: {AUX_IDS_KEY!r} is {top!r} at the top level but {nested!r} under "
            f"'eagle_config'; keep one of them (vLLM reads the top-level one)"
        )
        raise ValueError(msg)
    ids = top if top is not None else nested
    key = AUX_IDS_KEY if top is not None else f"eagle_config.{AUX_IDS_KEY}"
    if ids is None:
        ids = vllm_default_aux_ids(num_policy_layers)
        key = f"{AUX_IDS_KEY} (absent: vLLM's default for a {num_policy_layers}-layer policy)"
    rule = f"distinct ints in 1..{num_policy_layers} (the policy has {num_policy_layers} layers)"
    if (
        not isinstance(ids, list | tuple)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or not all(1 <= i <= num_policy_layers for i in ids)
        or len(set(ids)) != len(ids)
    ):
        msg = (
            f"{source}: {key} = {ids!r} must be a non-empty list of {rule}; id k reads the "
            f"output of decoder layer k - 1: write the policy layers the draft was trained on "
            f"as {AUX_IDS_KEY!r} at the top level of config.json"
        )
        raise ValueError(msg)
    return tuple(ids)


def read_eagle3_config(folder: Path, *, num_policy_layers: int) -> tuple[Any, tuple[int, ...]]:
    """The draft's Llama config from `folder`/config.json and the policy layers it reads, as
    `aux_layer_indices` (the layer each aux hidden state leaves)."""
    from transformers import LlamaConfig

    path = folder / "config.json"
    meta = json.loads(path.read_text())
    ids = eagle3_aux_layer_ids(meta, num_policy_layers=num_policy_layers, source=str(path))
    return LlamaConfig(**meta), tuple(i - 1 for i in ids)

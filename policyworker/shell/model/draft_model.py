"""The Eagle3 draft model itself: its layers, its config shaped like the policy's, and the
Hugging Face Eagle3 config.json that vLLM loads as a speculative model. Training it beside the
policy is `shell/worker/draft.py`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["Eagle3Draft", "default_aux_layers", "eagle3_config"]


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

"""Random HF causal LMs built from a config, nothing downloaded: for tests, benches, examples.

    model = tiny_model("qwen2", vocab=128, seed=1)       # an nn.Module, tiny unless told
    path = tiny_model_folder(tmp / "m", tokenizer=True)  # saved like any HF checkpoint

The defaults are one tiny decoder (2 layers, hidden 32, 4 heads, 2 KV heads); every other HF
config key passes through (`hidden_size=1536, num_hidden_layers=28, ...`), so the benches build
their full-size shapes with the same call. The tokenizer is word-level: token `t{i}` is id `i`,
`t1` ends a sequence and `t0` stands for unknown words.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "ARCHITECTURES",
    "TINY_SHAPE",
    "save_word_tokenizer",
    "tiny_config",
    "tiny_model",
    "tiny_model_folder",
]

# The decoder shape every test shares: 2 layers, 4 heads, head dim 8.
TINY_SHAPE: Mapping[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
# architecture -> (config class, config keys it needs beyond TINY_SHAPE)
ARCHITECTURES: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
}


def tiny_config(
    arch: str = "llama", *, vocab: int = 128, layers: int | None = None, **config: Any
) -> PretrainedConfig:
    """The HF config of a tiny `arch` decoder: `TINY_SHAPE`, `vocab` tokens, `layers` layers,
    then `config` (any HF config key) over it.

    Raises:
        ValueError: `arch` is not one of `ARCHITECTURES`, or `vocab` / `layers` is below 1.
    """
    if arch not in ARCHITECTURES:
        msg = f"arch={arch!r}: no tiny model of that kind; use one of {sorted(ARCHITECTURES)}"
        raise ValueError(msg)
    for key, value in (("vocab", vocab), ("layers", layers)):
        if value is not None and value < 1:
            msg = f"{key}={value}: a model needs at least 1; pass a positive count"
            raise ValueError(msg)
    import transformers

    class_name, extra = ARCHITECTURES[arch]
    keys = {**TINY_SHAPE, **extra, "vocab_size": vocab, **config}
    if layers is not None:
        keys["num_hidden_layers"] = layers
    return getattr(transformers, class_name)(**keys)


def tiny_model(
    arch: str = "llama",
    *,
    vocab: int = 128,
    layers: int | None = None,
    seed: int = 0,
    init_std: float | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **config: Any,
) -> PreTrainedModel:
    """A random causal LM of `tiny_config(arch, vocab=..., layers=..., **config)`, built under
    `torch.manual_seed(seed)` (same bits in every process) on `device` in `dtype`.

    `init_std` redraws every matrix from N(0, init_std): 0.2 puts logprobs far from uniform,
    which tests comparing logprobs want."""
    import transformers

    cfg = tiny_config(arch, vocab=vocab, layers=layers, **config)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    if init_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 2:
                    param.normal_(0, init_std)
    return model


def tiny_model_folder(
    path: str | Path,
    arch: str = "llama",
    *,
    vocab: int = 128,
    layers: int | None = None,
    seed: int = 0,
    init_std: float | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tokenizer: bool = False,
    **config: Any,
) -> str:
    """Save `tiny_model(...)` (and with `tokenizer`, a word-level tokenizer of `vocab` words)
    into `path`; return `path` as text, ready for a worker's `model_name`."""
    model = tiny_model(
        arch,
        vocab=vocab,
        layers=layers,
        seed=seed,
        init_std=init_std,
        dtype=dtype,
        device=device,
        **config,
    )
    model.save_pretrained(path)
    del model
    if tokenizer:
        save_word_tokenizer(path, vocab=vocab)
    return str(path)


def save_word_tokenizer(path: str | Path, *, vocab: int) -> None:
    """A word-level tokenizer of `vocab` words `t0..t{vocab-1}` into `path` (eos `t1`, unknown
    `t0`, no pad token); text splits on whitespace, so "t2 t3" is [2, 3] and decodes back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1", unk_token="t0")
    fast.save_pretrained(path)

"""Tiny real HF models (Llama / Qwen2 / Qwen3 + reward heads).

Saved once per session, loaded by path.
"""

from __future__ import annotations

import pytest
import torch

from policyworker.testing import tiny_config, tiny_model_folder

# Tiny models on a shared 2-core box: extra intra-op threads only add OpenMP contention.
torch.set_num_threads(1)

VOCAB = 128
# Tokens 1 and 2 end and start a sequence (the generation tests stop on eos 1).
_COMMON = dict(use_cache=True, eos_token_id=1, bos_token_id=2)


_SEEDS = {"llama": 0, "qwen2": 1, "qwen3": 2}


def save_tiny(folder, kind: str = "llama") -> str:
    """Save the session fixture's tiny `kind` model into `folder` (for tests outside pytest's
    fixtures: subprocess scenarios and spawned ranks); return the folder as text."""
    return tiny_model_folder(folder, kind, vocab=VOCAB, seed=_SEEDS[kind], init_std=0.2, **_COMMON)


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory) -> dict[str, str]:
    """{'llama' | 'qwen2' | 'qwen3': folder} of tiny causal LMs without tokenizer files
    (matrices drawn from N(0, 0.2) so logprobs are far from uniform)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: save_tiny(root / kind, kind) for kind in _SEEDS}


@pytest.fixture(scope="session")
def tiny_tokenizer_model_path(tmp_path_factory) -> str:
    """A tiny Llama folder that also holds a word-level tokenizer (no pad token, eos 't1')."""
    folder = tmp_path_factory.mktemp("tiny_with_tokenizer") / "llama"
    return tiny_model_folder(folder, "llama", vocab=VOCAB, init_std=0.2, tokenizer=True, **_COMMON)


@pytest.fixture(scope="session")
def tiny_reward_paths(tmp_path_factory) -> dict[str, str]:
    """{'bradley_terry' | 'regression': folder} of tiny Llama reward models (num_labels=1)."""
    import transformers

    root = tmp_path_factory.mktemp("tiny_rm")
    cfg = tiny_config("llama", vocab=VOCAB, num_labels=1, pad_token_id=0, **_COMMON)
    paths = {}
    for kind, cls in (
        ("bradley_terry", transformers.LlamaForSequenceClassification),
        ("regression", transformers.LlamaForTokenClassification),
    ):
        torch.manual_seed(3)
        folder = root / kind
        cls(cfg).save_pretrained(folder)
        paths[kind] = str(folder)
    return paths


def make_config(model_path: str, **overrides) -> dict:
    """A float32 worker config mapping over `model_path` with small batches."""
    cfg = {
        "model_name": model_path,
        "precision": "float32",
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.0}},
    }
    cfg.update(overrides)
    return cfg


def make_batch(batch_size: int = 4, seq_len: int = 12, *, seed: int = 0, lengths=None) -> dict:
    """Right-padded random ids (pad id 0) with rows of different lengths, masks and PG inputs."""
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(2, seq_len + 1, (batch_size,), generator=gen)
        lengths[0] = seq_len
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    ids = torch.randint(3, VOCAB, (batch_size, seq_len), generator=gen)
    valid = torch.arange(seq_len)[None] < lengths[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    token_mask = valid.float() * (torch.rand(batch_size, seq_len, generator=gen) > 0.2).float()
    token_mask[:, 0] = 0
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch_size),
        "advantages": torch.randn(batch_size, seq_len, generator=gen),
        "prev_logprobs": -torch.rand(batch_size, seq_len, generator=gen) * 3,
        "generation_logprobs": -torch.rand(batch_size, seq_len, generator=gen) * 3,
        "reference_policy_logprobs": -torch.rand(batch_size, seq_len, generator=gen) * 3,
    }


def hf_reference_logprobs(model_path: str, data: dict, *, temperature: float = 1.0) -> torch.Tensor:
    """Plain HF fp32 forward + log_softmax with the zero conventions (column 0, >= len)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32
    ).eval()
    ids = data["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    valid = torch.arange(ids.shape[1])[None] < data["input_lengths"][:, None]
    return torch.where(valid, lp, torch.zeros_like(lp))

"""Prompts in, tokens out: the rows of `data.train_file` (JSONL or Parquet) tokenised with the model
folder's tokenizer (its chat template when it has one and `data.use_chat_template`), and the
responses decoded back to text for the reward function."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import frozen

from policyworker.grpo.config import DataSection
from policyworker.grpo.loading import read_prompt_rows

__all__ = ["PromptSet", "decode_responses", "encode_prompt", "load_prompts"]


@frozen(kw_only=True)
class PromptSet:
    """The dataset: per row its text, its token ids and the metadata the reward sees."""

    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]
    metadata: tuple[dict[str, Any], ...]

    def __len__(self) -> int:
        return len(self.texts)


def encode_prompt(tokenizer: Any, text: str, *, use_chat_template: bool) -> list[int]:
    """Token ids of `text` as a user turn (chat template, generation prompt added) when the
    tokenizer has a template and it is wanted, else the plain encoding."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if isinstance(out, Mapping) else out
    else:
        ids = tokenizer(text)["input_ids"]
    return [int(i) for i in ids]


def load_prompts(section: DataSection, *, base_dir: str, tokenizer: Any) -> PromptSet:
    """Read and tokenise every prompt of `section.train_file` (relative to `base_dir`).

    Raises:
        ValueError: a prompt encodes to no token (named by its line).
    """
    rows = read_prompt_rows(
        pathlib.Path(base_dir, section.train_file), prompt_key=section.prompt_key
    )
    texts, ids, meta = [], [], []
    for number, row in enumerate(rows, start=1):
        text = row[section.prompt_key]
        tokens = encode_prompt(tokenizer, text, use_chat_template=section.use_chat_template)
        if not tokens:
            msg = (
                f"data.train_file row {number}: prompt {text!r} encodes to no token; give it "
                f"text the tokenizer knows"
            )
            raise ValueError(msg)
        keys = section.metadata_keys
        extra = {k: v for k, v in row.items() if k != section.prompt_key}
        if keys is not None:
            extra = {k: row.get(k) for k in keys}
        texts.append(text)
        ids.append(tuple(tokens))
        meta.append(extra)
    return PromptSet(texts=tuple(texts), token_ids=tuple(ids), metadata=tuple(meta))


def decode_responses(tokenizer: Any, responses: Sequence[Sequence[int]]) -> list[str]:
    """Response texts for the reward, special tokens (eos) dropped."""
    return [tokenizer.decode(list(r), skip_special_tokens=True) for r in responses]

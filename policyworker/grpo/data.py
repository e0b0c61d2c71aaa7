"""Prompts in, tokens out: the rows of `data.train_file` (JSONL or Parquet) tokenised with the
model folder's tokenizer (the chat template `policy.tokenizer.chat_template` picks, when there is
one and `data.use_chat_template`), and the responses decoded back to text for the reward."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import frozen

from policyworker.config import PolicyConfig
from policyworker.grpo.config import DataSection
from policyworker.grpo.loading import read_prompt_rows

__all__ = [
    "PASSTHROUGH_TEMPLATE",
    "PromptSet",
    "chat_template_file",
    "decode_responses",
    "encode_prompt",
    "load_prompts",
    "load_tokenizer",
]

# NeMo-RL's template for `policy.tokenizer.chat_template: null`: the messages' text, nothing added.
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@frozen(kw_only=True)
class PromptSet:
    """The dataset: per row its text, its token ids and the metadata the reward sees."""

    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]
    metadata: tuple[dict[str, Any], ...]

    def __len__(self) -> int:
        return len(self.texts)


def chat_template_file(choice: str | None, *, base_dir: str) -> pathlib.Path | None:
    """The file a `policy.tokenizer.chat_template` of `*.jinja` names (relative to `base_dir`,
    the run file's folder), else None."""
    if choice is None or not choice.endswith(".jinja"):
        return None
    return pathlib.Path(base_dir, choice)


def load_tokenizer(policy: PolicyConfig, *, base_dir: str) -> Any:
    """The tokenizer of `policy.tokenizer_name`, its chat template as NeMo-RL's
    `policy.tokenizer.chat_template` says ("default": the tokenizer's own; None: passthrough;
    a `*.jinja` path or a literal template), pad = eos when it has no pad token (as the worker).

    Raises:
        ValueError: no tokenizer loads from the name, or the template file does not read.
    """
    from transformers import AutoTokenizer

    name = policy.tokenizer_name
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        msg = (
            f"policy.model_name / policy.tokenizer.name {name!r}: no tokenizer loads from it "
            f"({type(exc).__name__}: {exc}); the grpo runner tokenises text prompts: save a "
            f"tokenizer there or set policy.tokenizer.name"
        )
        raise ValueError(msg) from exc
    choice = policy.tokenizer.chat_template
    template_file = chat_template_file(choice, base_dir=base_dir)
    if choice is None:
        tokenizer.chat_template = PASSTHROUGH_TEMPLATE
    elif template_file is not None:
        tokenizer.chat_template = template_file.read_text()
    elif choice != "default":
        tokenizer.chat_template = choice
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_prompt(
    tokenizer: Any,
    text: str,
    *,
    use_chat_template: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of `text` as a user turn (chat template, generation prompt added, with
    `template_kwargs` such as enable_thinking) when the tokenizer has a template and it is
    wanted, else the plain encoding."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            **dict(template_kwargs or {}),
        )
        ids = out["input_ids"] if isinstance(out, Mapping) else out
    else:
        ids = tokenizer(text)["input_ids"]
    return [int(i) for i in ids]


def load_prompts(
    section: DataSection,
    *,
    base_dir: str,
    tokenizer: Any,
    template_kwargs: Mapping[str, Any] | None = None,
) -> PromptSet:
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
        tokens = encode_prompt(
            tokenizer,
            text,
            use_chat_template=section.use_chat_template,
            template_kwargs=template_kwargs,
        )
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

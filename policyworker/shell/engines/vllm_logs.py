"""vLLM log records that are expected in a run refit by policyworker, dropped by name.

Each rule names the vLLM logger, the start of the message, and why the record is not a failure.
Anything else vLLM logs passes unchanged, and so does any record of these loggers that no rule
matches (another layer failing to load, a chat-template error on an engine that has a tokenizer):

- `RotaryEmbedding: Failed to load weights` (vLLM's layerwise reload, in its worker process, once
  per refit): the reload warns for every layer that got no checkpoint tensor, and the rotary
  embedding's cos/sin cache is computed from the config, never sent.
- `Chat template warmup failed` with its traceback (vLLM's renderer, at start-up): an engine
  built with `skip_tokenizer_init=True` (token ids in, token ids out) has no tokenizer to render
  a template with.
- `[shutdown] ... force killing ...` (vLLM's process managers): logged when an engine process had
  not exited within vLLM's grace period after a shutdown; dropped only inside
  `expected_vllm_shutdown()`, i.e. while we are closing the engine ourselves.

`silence_expected_vllm_noise()` installs the filter (idempotent); the demo calls it before it
builds its engine and `vllm_worker` calls it in vLLM's worker processes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from attrs import frozen

__all__ = [
    "RULES",
    "ExpectedVllmNoise",
    "NoiseRule",
    "expected_vllm_shutdown",
    "silence_expected_vllm_noise",
]


@frozen
class NoiseRule:
    logger: str
    prefix: str
    only_while_closing: bool = False
    # Substrings of the attached exception text, one of which must appear (empty: none needed).
    exception_contains: tuple[str, ...] = ()


RULES = (
    NoiseRule(
        "vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load"
    ),
    NoiseRule(
        "vllm.renderers.base",
        "Chat template warmup failed",
        exception_contains=("skip_tokenizer_init",),
    ),
    NoiseRule("vllm.v1.utils", "[shutdown]", only_while_closing=True),
    NoiseRule("vllm.utils.system_utils", "[shutdown] force killing", only_while_closing=True),
)

_closing = threading.Event()


class ExpectedVllmNoise(logging.Filter):
    """Drops the records `RULES` describe; keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for rule in RULES:
            if record.name != rule.logger or not message.startswith(rule.prefix):
                continue
            if rule.only_while_closing and not _closing.is_set():
                continue
            if rule.exception_contains and not _exception_mentions(record, rule):
                continue
            return False
        return True


def _exception_mentions(record: logging.LogRecord, rule: NoiseRule) -> bool:
    if record.exc_info is None or record.exc_info[1] is None:
        return False
    text = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
    return any(word in text for word in rule.exception_contains)


_FILTER = ExpectedVllmNoise()


def silence_expected_vllm_noise() -> None:
    """Attach the filter to each logger `RULES` names (a logger's filters see the records logged
    on it, before any handler); calling it again changes nothing."""
    for name in {rule.logger for rule in RULES}:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


@contextlib.contextmanager
def expected_vllm_shutdown() -> Iterator[None]:
    """While inside, vLLM's force-kill notices at shutdown are expected (we asked it to stop)."""
    _closing.set()
    try:
        yield
    finally:
        _closing.clear()

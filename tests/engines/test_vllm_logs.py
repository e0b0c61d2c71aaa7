"""The vLLM log filter drops exactly the expected records (by logger, message and, for the chat
template, the exception) and lets every other record through. Needs no vLLM: the records are
logged on vLLM's logger names."""

from __future__ import annotations

import logging

import pytest

from policyworker.shell.engines.vllm_logs import (
    RULES,
    expected_vllm_shutdown,
    silence_expected_vllm_noise,
)

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
RENDERER = "vllm.renderers.base"
PROCESSES = "vllm.v1.utils"
SYSTEM = "vllm.utils.system_utils"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured():
    """A handler on each logger the rules name and on `vllm.engine` (vLLM's own logging config
    stops propagation at `vllm`, so the root logger may see nothing)."""
    names = {rule.logger for rule in RULES} | {"vllm.engine"}
    handler = _Records()
    silence_expected_vllm_noise()
    silence_expected_vllm_noise()  # idempotent: one filter per logger
    for name in names:
        logging.getLogger(name).addHandler(handler)
    for rule in RULES:
        assert len(logging.getLogger(rule.logger).filters) == 1
    yield handler
    for name in names:
        logging.getLogger(name).removeHandler(handler)
        logging.getLogger(name).filters.clear()


def _messages(handler) -> list[str]:
    return [r.getMessage() for r in handler.records]


def _warn_with(logger: str, message: str, exc: Exception) -> None:
    try:
        raise exc
    except type(exc):
        logging.getLogger(logger).warning(message, exc_info=True)


def test_the_rotary_embedding_reload_notice_goes_and_any_other_layer_stays(captured):
    logging.getLogger(LAYERWISE).warning("%s: Failed to load weights", "RotaryEmbedding")
    logging.getLogger(LAYERWISE).warning("%s: Failed to load weights", "QKVParallelLinear")
    assert _messages(captured) == ["QKVParallelLinear: Failed to load weights"]


def test_the_chat_template_warmup_goes_only_when_the_engine_skipped_its_tokenizer(captured):
    skipped = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    broken = KeyError("messages")
    _warn_with(RENDERER, "Chat template warmup failed", skipped)
    _warn_with(RENDERER, "Chat template warmup failed", broken)
    assert len(captured.records) == 1
    assert captured.records[0].exc_info[1] is broken


def test_force_kill_notices_go_only_while_we_close_the_engine(captured):
    notice = "[shutdown] Process manager: force killing remaining processes count=%d"
    logging.getLogger(PROCESSES).warning(notice, 1)  # not closing: a real problem, kept
    with expected_vllm_shutdown():
        logging.getLogger(PROCESSES).warning(notice, 1)
        logging.getLogger(SYSTEM).warning("[shutdown] force killing sub process %s pid %d", "x", 7)
    logging.getLogger(SYSTEM).warning("[shutdown] force killing sub process %s pid %d", "x", 7)
    assert _messages(captured) == [
        "[shutdown] Process manager: force killing remaining processes count=1",
        "[shutdown] force killing sub process x pid 7",
    ]


def test_other_vllm_loggers_and_messages_pass_unchanged(captured):
    logging.getLogger("vllm.engine").warning("RotaryEmbedding: Failed to load weights")
    logging.getLogger(LAYERWISE).error("weights missing: model.layers.0.mlp")
    logging.getLogger(RENDERER).warning("Chat template is malformed")
    assert len(captured.records) == 3

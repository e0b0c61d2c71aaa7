"""What the library says: the ``policyworker`` logger, its verbosity switch, quiet third parties.

Every module logs under the ``policyworker`` logger hierarchy (``logging.getLogger(__name__)``
inside the package) and the library attaches no handler of its own unless asked, so an
application's logging setup decides what is shown. Two switches show our INFO lines (the
worker's start-up summary, "waiting for a receiver at ..."):

- ``policyworker.set_verbosity("info")`` (or "debug", "warning", "error", or a ``logging``
  level number), which also attaches one stderr handler to the ``policyworker`` logger;
- the environment variable ``POLICYWORKER_LOG_LEVEL=info``, read when a worker is built.

Third-party progress bars (transformers' "Loading weights") are switched off while the
library loads a model and restored afterwards (``quiet_progress_bars``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from policyworker.config import PolicyConfig
    from policyworker.shell.kernels.fusion import FusionReport
    from policyworker.shell.model.float8 import Float8Report
    from policyworker.shell.parallel.context import ParallelContext

__all__ = [
    "ENV_LOG_LEVEL",
    "LOGGER_NAME",
    "SummarizedWorker",
    "apply_env_verbosity",
    "quiet_progress_bars",
    "set_verbosity",
    "startup_summary",
]

LOGGER_NAME = "policyworker"
ENV_LOG_LEVEL = "POLICYWORKER_LOG_LEVEL"
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
_handler: logging.Handler | None = None


def _level(value: str | int, *, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    level = _LEVELS.get(str(value).strip().lower())
    if level is None:
        msg = (
            f"{source}={value!r} is not a log level; use one of "
            f"{', '.join(k for k in _LEVELS if k != 'warn')} (or a logging level number)"
        )
        raise ValueError(msg)
    return level


def set_verbosity(level: str | int) -> None:
    """Show the library's messages at ``level`` and above on stderr ("info" shows the worker's
    start-up summary; "warning" is Python's default). Idempotent: one handler at most."""
    global _handler
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(_level(level, source="set_verbosity level"))
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("[policyworker] %(levelname)s %(message)s"))
        logger.addHandler(_handler)


def apply_env_verbosity() -> None:
    """``set_verbosity($POLICYWORKER_LOG_LEVEL)`` when the variable is set (and not empty)."""
    value = os.environ.get(ENV_LOG_LEVEL, "").strip()
    if value:
        set_verbosity(_level(value, source=ENV_LOG_LEVEL))


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' / huggingface_hub's tqdm bars off inside the block; the previous state after.

    Only bars: transformers' warnings still reach its logger.
    """
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # nothing to silence
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


class SummarizedWorker(Protocol):
    """What `startup_summary` reads of a built worker (a PolicyWorker's `WorkerState` is one)."""

    @property
    def cfg(self) -> PolicyConfig: ...
    @property
    def parallel(self) -> ParallelContext: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...
    @property
    def lora_module_names(self) -> Sequence[str]: ...
    @property
    def fusion_report(self) -> FusionReport: ...
    @property
    def float8_report(self) -> Float8Report: ...
    @property
    def reference_state(self) -> dict[str, torch.Tensor] | None: ...


def startup_summary(worker: SummarizedWorker, *, name: str) -> str:
    """One line: what a built worker (`name`, its class) is: model, parameters, precision,
    layout, kernel, batching."""
    cfg, parallel, model = worker.cfg, worker.parallel, worker.model
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = f"{_count(total)} params" + (
        "" if trainable == total else f", {_count(trainable)} trainable"
    )
    if cfg.dynamic_batching is not None:
        dyn = cfg.dynamic_batching
        batching = (
            f"dynamic (train {dyn.train_mb_tokens} tokens/mb, "
            f"logprob {dyn.logprob_tokens} tokens/mb)"
        )
    elif cfg.sequence_packing is not None:
        sp = cfg.sequence_packing
        batching = (
            f"packed {sp.algorithm} (train {sp.train_mb_tokens} tokens/mb, "
            f"logprob {sp.logprob_tokens} tokens/mb)"
        )
    else:
        batching = (
            f"fixed (train mbs {cfg.train_micro_batch_size} of gbs "
            f"{cfg.train_global_batch_size}, logprob mbs {cfg.logprob_batch_size})"
        )
    dcfg = cfg.dtensor_cfg
    extras = []
    if worker.lora_module_names:
        extras.append(f"lora on {len(worker.lora_module_names)} modules")
    fusion = worker.fusion_report.summary()
    if fusion != "none":
        extras.append(f"fusion={fusion}")
    if worker.float8_report.requested:
        extras.append(f"fp8={worker.float8_report.summary()}")
    if dcfg.activation_checkpointing:
        extras.append("activation checkpointing")
    optimizer = cfg.optimizer.name if worker.optimizer is not None and cfg.optimizer else "none"
    return (
        f"{name} ready: model={cfg.model_name} "
        f"({getattr(model.config, 'model_type', '?')}, {params}) "
        f"precision={str(worker.dtype).removeprefix('torch.')} (fp32 master weights) "
        f"device={worker.device.type} dp×cp×tp={parallel.dp_size}×{parallel.cp_size}×"
        f"{parallel.tp_size} attention={getattr(model.config, '_attn_implementation', '?')} "
        f"batching={batching} optimizer={optimizer} "
        f"reference={'kept' if worker.reference_state is not None else 'none'}"
        + (f" ({', '.join(extras)})" if extras else "")
    )

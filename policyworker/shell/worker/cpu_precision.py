"""A one-time start-up warning when `precision: bf16` runs on a CPU without bf16 instructions.

Without AVX512-BF16 or AMX, oneDNN emulates bf16 matmuls through fp32 conversions, and bf16 is
then much slower than fp32. Measured (2-layer Llama, hidden 256, batch 8 x 128 tokens, one
thread, torch 2.13, AMD EPYC):

    CPU ISA used by torch                        train step       get_logprobs
    AVX512 with avx512_bf16 (this CPU as is)     bf16 1.5x faster bf16 1.4x faster
    AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, no bf16 ops)  bf16 8x slower   bf16 3.5x slower

So the warning fires only where torch reports no bf16 support on this CPU: a CPU with
avx512_bf16 or AMX trains bf16 at fp32 speed or better, and stays silent.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

__all__ = ["BF16_CPU_SLOWDOWN", "bf16_cpu_message", "cpu_has_bf16", "warn_if_slow_cpu_precision"]

log = logging.getLogger(__name__)

BF16_CPU_SLOWDOWN = "about 8x slower to train and 3.5x slower to score logprobs than fp32"


def cpu_has_bf16() -> bool | None:
    """Whether torch's oneDNN runs bf16 matmuls natively on this CPU (None: cannot tell)."""
    probe: Callable[[], bool] | None = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return bool(probe())
    except RuntimeError:
        return None


def bf16_cpu_message(*, device_type: str, dtype: torch.dtype, has_bf16: bool | None) -> str:
    """The warning for this device and precision, or '' when there is nothing to say."""
    if device_type != "cpu" or dtype != torch.bfloat16 or has_bf16 is not False:
        return ""
    return (
        "precision bf16 on a CPU without bf16 instructions (no AVX512-BF16 or AMX): measured "
        f"{BF16_CPU_SLOWDOWN} on such a CPU. Set policy.precision: fp32 (or train on a GPU, "
        "or on a CPU with avx512_bf16/amx_bf16 in lscpu's flags)."
    )


def warn_if_slow_cpu_precision(device: torch.device, dtype: torch.dtype, *, rank: int) -> None:
    """Log the warning once per process, on rank 0 only."""
    if rank != 0 or device.type != "cpu" or dtype != torch.bfloat16:
        return
    message = bf16_cpu_message(device_type=device.type, dtype=dtype, has_bf16=cpu_has_bf16())
    if message:
        _warn_once(message)


@functools.cache
def _warn_once(message: str) -> None:
    # Cached by message: a second worker in the same process (a reference model, a test) is
    # as slow as the first, and saying so again adds nothing.
    log.warning("%s", message)

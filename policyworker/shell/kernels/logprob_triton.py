"""The plain next-token logprob pair of `functional.logprob_kernels` as two Triton kernels (CUDA).

Inductor's compile of the same functions reads the bf16 logits at about 0.5 TB/s on an H200
(a 16k x 151,936 block took 9.7 ms in its logsumexp reduction, 1.2 TB/s in the backward), an
eighth of the memory's speed, and that block is the largest tensor of a train step or a
`get_logprobs` call. These kernels do the same math in one read:

- forward, one program per position: walk the vocab in blocks, keep the running max and the
  sum of ``exp(x - max)`` rescaled when the max grows (one exp per logit), then read the
  target's logit; out come ``logprob = x[target] - lse`` and ``lse``, both fp32;
- backward, one program per (position, vocab block): ``g * (onehot(target) - exp(x - lse))``
  (divided by the temperature) written once in the logits' dtype.
- entropy, one program per position: the forward's walk, also keeping the sum of
  ``exp(x - max) * (x - max)`` rescaled with it; out comes ``log(sum) - that / sum`` in fp32
  (for ``get_logprobs(entropy=True)``: the eager version reads and writes about 80 bytes per
  logit).

The math is `plain_logprobs_and_lse` / `plain_logprob_grad` / `plain_entropy`'s; the sums run
in another order,
so values agree to `shell.fused_logprobs.LOGPROB_ATOL/RTOL` (checked at start-up like the
compiled pair). Padding positions keep their contract: ``lse = +inf`` with ``grad = 0`` gives
an exact zero gradient row. Logits may be any [B, C, V] view whose vocab dimension is dense
(a slice of positions of a longer block is read in place, not copied).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from policyworker.functional.logprob_kernels import LogprobKernels

__all__ = ["TRITON_KERNELS", "triton_entropy", "triton_logprob_grad", "triton_logprobs_and_lse"]

# Logits per block: 4,096 bf16 are 8 KiB, enough loads in flight per program to stream from
# HBM, and a 151,936 vocab takes 38 blocks.
_BLOCK = 4096
_WARPS = 8


@triton.jit
def _this_position(
    logits_ptr,
    targets_ptr,
    positions,
    logits_stride_b,
    logits_stride_c,
    targets_stride_b,
    targets_stride_c,
):
    """(row index, pointer to the row's logits, target id) of this program's position."""
    row = tl.program_id(0)
    b = (row // positions).to(tl.int64)
    c = (row % positions).to(tl.int64)
    target = tl.load(targets_ptr + b * targets_stride_b + c * targets_stride_c)
    return row, logits_ptr + b * logits_stride_b + c * logits_stride_c, target


@triton.jit
def _scaled_block(row_ptr, start, vocab, temperature, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """The row's logits [start, start + BLOCK) in fp32, divided by the temperature (-inf past
    the vocab, so they add nothing to a max or a sum of exponentials)."""
    offsets = start + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offsets, mask=offsets < vocab, other=-float("inf")).to(tl.float32)
    if SCALED:
        x = x / temperature
    return x


@triton.jit
def _shift_for(running_max, x):
    """(the new running max with block `x`, the shift the block's exponentials use): 0 while
    the max is still -inf, so no (-inf) - (-inf) appears."""
    new_max = tl.maximum(running_max, tl.max(x, axis=0))
    return new_max, tl.where(new_max == -float("inf"), 0.0, new_max)


@triton.jit
def _logprobs_and_lse_kernel(
    logits_ptr,
    targets_ptr,
    logprobs_ptr,
    lse_ptr,
    positions,
    vocab,
    logits_stride_b,
    logits_stride_c,
    targets_stride_b,
    targets_stride_c,
    temperature,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, row_ptr, target = _this_position(
        logits_ptr,
        targets_ptr,
        positions,
        logits_stride_b,
        logits_stride_c,
        targets_stride_b,
        targets_stride_c,
    )
    running_max = tl.zeros([], dtype=tl.float32) - float("inf")
    running_sum = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x = _scaled_block(row_ptr, start, vocab, temperature, SCALED, BLOCK)
        new_max, shift = _shift_for(running_max, x)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    x_target = tl.load(row_ptr + target).to(tl.float32)
    if SCALED:
        x_target = x_target / temperature
    tl.store(logprobs_ptr + row, x_target - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logprob_grad_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    grad_ptr,
    out_ptr,
    positions,
    vocab,
    logits_stride_b,
    logits_stride_c,
    targets_stride_b,
    targets_stride_c,
    temperature,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, row_ptr, target = _this_position(
        logits_ptr,
        targets_ptr,
        positions,
        logits_stride_b,
        logits_stride_c,
        targets_stride_b,
        targets_stride_c,
    )
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < vocab
    x = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x = x / temperature
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_ptr + row)
    grad = tl.where(offsets == target, g, 0.0) - g * tl.exp(x - lse)
    if SCALED:
        grad = grad / temperature
    out_row = out_ptr + row.to(tl.int64) * vocab
    tl.store(out_row + offsets, grad.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _entropy_kernel(
    logits_ptr,
    entropy_ptr,
    positions,
    vocab,
    logits_stride_b,
    logits_stride_c,
    temperature,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    b = (row // positions).to(tl.int64)
    c = (row % positions).to(tl.int64)
    row_ptr = logits_ptr + b * logits_stride_b + c * logits_stride_c
    running_max = tl.zeros([], dtype=tl.float32) - float("inf")
    running_sum = tl.zeros([], dtype=tl.float32)  # sum of exp(x - max)
    running_centred = tl.zeros([], dtype=tl.float32)  # sum of exp(x - max) * (x - max)
    for start in range(0, vocab, BLOCK):
        x = _scaled_block(row_ptr, start, vocab, temperature, SCALED, BLOCK)
        new_max, shift = _shift_for(running_max, x)
        # moving the sums from the old max to the new one: exp(x - new) = exp(x - old) * scale
        # and x - new = (x - old) + moved; an empty prefix (old max -inf) has nothing to move
        moved = tl.where(running_max == -float("inf"), 0.0, running_max - shift)
        scale = tl.exp(running_max - shift)
        centred = x - shift
        weights = tl.exp(centred)
        running_centred = scale * (running_centred + moved * running_sum) + tl.sum(
            tl.where(weights > 0, weights * centred, 0.0), axis=0
        )
        running_sum = running_sum * scale + tl.sum(weights, axis=0)
        running_max = new_max
    tl.store(entropy_ptr + row, tl.log(running_sum) - running_centred / running_sum)


def _dense_vocab(logits_BCV: torch.Tensor) -> torch.Tensor:
    return logits_BCV if logits_BCV.stride(-1) == 1 else logits_BCV.contiguous()


def _position_args(
    logits: torch.Tensor, targets_BC: torch.Tensor, temperature: float
) -> tuple[Any, ...]:
    """Both kernels' arguments after their pointers: sizes, strides and the temperature."""
    _, positions, vocab = logits.shape
    return (
        positions,
        vocab,
        logits.stride(0),
        logits.stride(1),
        targets_BC.stride(0),
        targets_BC.stride(1),
        float(temperature),
    )


def _launch_options(temperature: float) -> dict[str, Any]:
    """Both kernels' compile-time constants and warps (``num_warps`` is a launch option)."""
    return {"SCALED": temperature != 1.0, "BLOCK": _BLOCK, "num_warps": _WARPS}


def triton_logprobs_and_lse(
    logits_BCV: torch.Tensor, targets_BC: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logprob of each target, fp32 logsumexp) of ``logits / temperature``, per position:
    `functional.logprob_kernels.plain_logprobs_and_lse` in one read of the logits."""
    logits = _dense_vocab(logits_BCV)
    batch, positions, vocab = logits.shape
    logprobs = torch.empty((batch, positions), dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logprobs)
    if logprobs.numel():
        _logprobs_and_lse_kernel[(batch * positions,)](
            logits,
            targets_BC,
            logprobs,
            lse,
            *_position_args(logits, targets_BC, temperature),
            **_launch_options(temperature),
        )
    return logprobs, lse


def triton_logprob_grad(
    logits_BCV: torch.Tensor,
    targets_BC: torch.Tensor,
    lse_BC: torch.Tensor,
    grad_BC: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``grad * (onehot(target) - softmax(logits / T)) / T`` in the logits' dtype, contiguous:
    `functional.logprob_kernels.plain_logprob_grad` in one read and one write."""
    logits = _dense_vocab(logits_BCV)
    batch, positions, vocab = logits.shape
    out = torch.empty((batch, positions, vocab), dtype=logits.dtype, device=logits.device)
    if out.numel():
        _logprob_grad_kernel[(batch * positions, triton.cdiv(vocab, _BLOCK))](
            logits,
            targets_BC,
            lse_BC.float().contiguous(),
            grad_BC.float().contiguous(),
            out,
            *_position_args(logits, targets_BC, temperature),
            **_launch_options(temperature),
        )
    return out


def triton_entropy(logits_BCV: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 entropy of ``softmax(logits / temperature)`` per position:
    `functional.logprob_kernels.plain_entropy` in one read of the logits."""
    logits = _dense_vocab(logits_BCV)
    batch, positions, vocab = logits.shape
    entropy = torch.empty((batch, positions), dtype=torch.float32, device=logits.device)
    if entropy.numel():
        _entropy_kernel[(batch * positions,)](
            logits,
            entropy,
            positions,
            vocab,
            logits.stride(0),
            logits.stride(1),
            float(temperature),
            **_launch_options(temperature),
        )
    return entropy


# The kernels as the worker runs them (`shell.fused_logprobs` on CUDA): no fp32 [C, V] scratch,
# so one call covers every position.
TRITON_KERNELS = LogprobKernels(
    forward=triton_logprobs_and_lse,
    backward=triton_logprob_grad,
    entropy=triton_entropy,
    whole=True,
    name="fused",
)

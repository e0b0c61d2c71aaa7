"""Next-token logprobs: chunked fp32 log-softmax, vLLM-style filters, vocab-parallel partials.

Convention (the worker's, as the README states): ``logprobs[b, t] = log p(x_t | x_<t)``
for ``1 <= t < len_b``, column 0 is 0 and positions ``>= len_b`` are 0. Internally
``next_token_logprobs`` scores logits at positions ``0..S-2`` against targets
``token_ids[:, 1:]`` ([B, S-1]); ``logprobs_with_leading_zero`` turns that into the [B, S]
convention.

Memory: ``next_token_logprobs`` is a custom autograd Function that saves only the caller's
(possibly bf16) logits, the targets and the fp32 ``[B, T]`` log-normalizers. Forward and
backward both work on one chunk of sequence positions at a time (cast to fp32, divide by
temperature, filter, logsumexp and gather; backward ``exp(x - lse)``), so no fp32 ``[B, S, V]``
tensor is ever alive besides the caller's own logits and their gradient (which have the logits'
dtype: bf16 logits get a bf16 gradient). The per-chunk math lives in
``functional.logprob_kernels``; fused (compiled) kernels run all positions in one call.

Filters and temperature come as one validated `Sampling` record (``functional.sampling``); the
vocab-parallel partials of the same log-softmax live in ``functional.vocab_parallel``.
``token_entropy`` is the softmax's entropy at every position, chunked the same way and built
from the same partials (with the whole vocab as one shard).

Shape legend: ``B`` batch, ``S`` sequence, ``V`` vocab (or the local vocab shard), ``N`` rows.
All functions are pure: no communication, no device queries, inputs are never mutated.
"""

from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from policyworker.functional.logprob_kernels import (
    EAGER_KERNELS,
    LogprobKernels,
    filtered_kernels,
)
from policyworker.functional.packing import int_list
from policyworker.functional.sampling import PLAIN_SAMPLING, Sampling, check_temperature

__all__ = [
    "check_logits_and_ids",
    "count_and_zero_neg_inf",
    "default_chunk_size",
    "logprobs_with_leading_zero",
    "next_token_logprobs",
    "shifted_targets",
    "target_logprobs",
    "token_entropy",
]

# default_chunk_size aims at this many bytes for one chunk's fp32 [chunk, V] block (batch 1).
_CHUNK_TARGET_BYTES = 128 * 1024 * 1024


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and chunk_size < 1:
        msg = f"chunk_size (logprob_chunk_size) {chunk_size} must be >= 1, or None for the default"
        raise ValueError(msg)


def default_chunk_size(vocab_size: int) -> int:
    """Sequence positions per chunk so that one fp32 ``[chunk, V]`` block is 64-128 MiB (batch 1).

    Rule: the largest power of two ``c`` with ``4 * c * V <= 128 MiB`` (at least 1). Since the
    next power of two would exceed 128 MiB, the block is always in (64, 128] MiB unless a single
    vocab row is larger than that. Examples: V=32000 -> 1024, V=151936 -> 128, V=128 -> 262144.

    Raises:
        ValueError: ``vocab_size < 1``.
    """
    if vocab_size < 1:
        msg = f"vocab_size {vocab_size} must be >= 1"
        raise ValueError(msg)
    rows = _CHUNK_TARGET_BYTES // (4 * vocab_size)
    return 1 if rows < 1 else 1 << (rows.bit_length() - 1)


# ----------------------------------------------------------------------------- chunked logprobs


def _chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def _positions_per_chunk(
    logits_BSV: torch.Tensor, chunk_size: int | None, kernels: LogprobKernels
) -> int:
    """The caller's `chunk_size`, else every position at once for fused kernels (no fp32
    scratch), else `default_chunk_size(V)`."""
    if chunk_size is not None:
        return chunk_size
    if kernels.whole:
        return max(logits_BSV.shape[1], 1)
    return default_chunk_size(logits_BSV.shape[-1])


def _pad_positions(x_BT: torch.Tensor, length: int, value: float) -> torch.Tensor:
    """``x_BT`` extended to ``length`` positions with `value` (no copy when already that long)."""
    missing = length - x_BT.shape[1]
    if missing == 0:
        return x_BT
    return torch.cat([x_BT, x_BT.new_full((x_BT.shape[0], missing), value)], dim=1)


class _ChunkedNextTokenLogprobs(torch.autograd.Function):
    """(logits_BSV any float dtype, targets_BT with T <= S) -> fp32 [B, T], chunk by chunk.

    Saves its two inputs and the fp32 [B, T] log-normalizers; backward recomputes each chunk's
    softmax from them (no second reduction) and writes the [B, S, V] gradient chunk by chunk,
    or in one call when the kernels are fused (`LogprobKernels.whole`).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        logits_BSV: torch.Tensor,
        targets_BT: torch.Tensor,
        temperature: float,
        chunk_size: int,
        kernels: LogprobKernels,
    ) -> torch.Tensor:
        num_positions = targets_BT.shape[1]
        out_BT = torch.empty(targets_BT.shape, dtype=torch.float32, device=logits_BSV.device)
        lse_BT = torch.empty_like(out_BT)
        for start, stop in _chunk_bounds(num_positions, chunk_size):
            out_BT[:, start:stop], lse_BT[:, start:stop] = kernels.forward(
                logits_BSV[:, start:stop], targets_BT[:, start:stop], temperature
            )
        ctx.save_for_backward(logits_BSV, targets_BT, lse_BT)
        ctx.settings = (temperature, chunk_size, kernels)  # type: ignore[attr-defined]
        return out_BT

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_BT: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        logits_BSV, targets_BT, lse_BT = ctx.saved_tensors
        temperature, chunk_size, kernels = ctx.settings
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        # Positions past T (the last one of next-token scoring) get a zero gradient row: their
        # upstream gradient is 0 and lse = +inf makes the softmax term exactly 0.
        num_positions = logits_BSV.shape[1]
        targets_BS = _pad_positions(targets_BT, num_positions, 0)
        lse_BS = _pad_positions(lse_BT, num_positions, float("inf"))
        grad_BS = _pad_positions(grad_BT.float(), num_positions, 0.0)
        bounds = _chunk_bounds(num_positions, chunk_size)
        grad_BSV = None if len(bounds) == 1 else torch.empty_like(logits_BSV)
        for start, stop in bounds:
            grad = kernels.backward(
                logits_BSV[:, start:stop],
                targets_BS[:, start:stop],
                lse_BS[:, start:stop],
                grad_BS[:, start:stop],
                temperature,
            )
            if grad_BSV is None:
                return grad, None, None, None, None
            grad_BSV[:, start:stop] = grad
        return grad_BSV, None, None, None, None


def shifted_targets(token_ids_BS: torch.Tensor, *, pad_id: int = -1) -> torch.Tensor:
    """``[B, S]`` next-token targets: ``token_ids[:, 1:]`` followed by a ``pad_id`` column.

    Position ``t`` of the result is the token that logits at position ``t`` predict (useful when a
    shard of positions, e.g. a CP shard, must be scored without the full sequence).
    """
    pad = torch.full_like(token_ids_BS[:, :1], pad_id)
    return torch.cat([token_ids_BS[:, 1:], pad], dim=1)


def next_token_logprobs(
    logits_BSV: torch.Tensor,
    token_ids_BS: torch.Tensor,
    *,
    sampling: Sampling = PLAIN_SAMPLING,
    chunk_size: int | None = None,
    kernels: LogprobKernels = EAGER_KERNELS,
) -> torch.Tensor:
    """fp32 ``[B, S-1]``: ``log_softmax(filter(logits[:, t] / T))[token_ids[:, t+1]]``.

    Equal to ``torch.log_softmax(apply_sampling_filters(logits.float() / T), -1).gather(...)`` but
    computed ``chunk_size`` sequence positions at a time (default ``default_chunk_size(V)``), in
    forward and in backward, so fp32 memory is bounded by one chunk. `kernels` computes each
    chunk without filters (``functional.logprob_kernels``); fused kernels (``whole``) keep no fp32
    scratch, so without a `chunk_size` they run once over all positions. Target ids outside
    ``[0, V)`` (padding such as -1) are clamped for the gather and score a meaningless finite
    value: callers mask those positions. ``S == 1`` gives an empty ``[B, 0]`` result.

    Raises:
        ValueError: shapes disagree, or chunk_size is out of range.
    """
    _check_scoring_args(logits_BSV, token_ids_BS, "token_ids")
    return _chunked_logprobs(logits_BSV, token_ids_BS[:, 1:], sampling, chunk_size, kernels)


def target_logprobs(
    logits_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    sampling: Sampling = PLAIN_SAMPLING,
    chunk_size: int | None = None,
    kernels: LogprobKernels = EAGER_KERNELS,
) -> torch.Tensor:
    """fp32 ``[B, S]``: ``log_softmax(filter(logits[:, t] / T))[targets[:, t]]``, no shift.

    The same chunked autograd Function as ``next_token_logprobs``, for targets that are already
    aligned with the logits: a CP shard scored against ``shard_for_rank(shifted_targets(ids))``,
    or the row blocks of the tensor-parallel top-k/top-p path.

    Raises:
        ValueError: shapes disagree, or chunk_size is out of range.
    """
    _check_scoring_args(logits_BSV, targets_BS, "targets")
    return _chunked_logprobs(logits_BSV, targets_BS, sampling, chunk_size, kernels)


def token_entropy(
    logits_BSV: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    kernels: LogprobKernels = EAGER_KERNELS,
) -> torch.Tensor:
    """fp32 ``[B, S]``: the entropy ``-sum_v p log p`` of ``softmax(logits[:, t] / T)`` at every
    position ``t`` (no shift, no sampling filters), in nats.

    `kernels.entropy` computes it ``chunk_size`` positions at a time (default: every position
    at once for fused kernels, ``default_chunk_size(V)`` for the eager one, so one fp32 chunk
    is alive). The eager one is differentiable through plain torch ops (no memory-saving
    backward); fused kernels are for inference (no gradient).

    Raises:
        ValueError: ``logits`` is not a floating ``[B, S, V]`` tensor with ``V >= 1``,
            temperature is not a finite number > 0, or chunk_size < 1.
    """
    if logits_BSV.dim() != 3 or not logits_BSV.is_floating_point() or logits_BSV.shape[-1] < 1:
        msg = (
            f"logits {tuple(logits_BSV.shape)} ({logits_BSV.dtype}) must be a floating "
            "[B, S, V] tensor with V >= 1"
        )
        raise ValueError(msg)
    check_temperature(temperature)
    _check_chunk_size(chunk_size)
    chunk = _positions_per_chunk(logits_BSV, chunk_size, kernels)
    parts = [logits_BSV.new_zeros((logits_BSV.shape[0], 0), dtype=torch.float32)]
    for start, stop in _chunk_bounds(logits_BSV.shape[1], chunk):
        parts.append(kernels.entropy(logits_BSV[:, start:stop], temperature))
    return torch.cat(parts, dim=1)


def check_logits_and_ids(
    logits_BSV: torch.Tensor, ids_BS: torch.Tensor, *, ids_name: str = "token_ids"
) -> None:
    """Raise ``ValueError`` unless logits are ``[B, S, V]`` and ids ``[B, S]`` (same B and S).

    Raises:
        ValueError: the shapes disagree; the message names both shapes.
    """
    shapes_ok = logits_BSV.dim() == 3 and ids_BS.dim() == 2
    if not shapes_ok or logits_BSV.shape[:2] != ids_BS.shape:
        msg = (
            f"logits {tuple(logits_BSV.shape)} must be [B, S, V] and {ids_name} "
            f"{tuple(ids_BS.shape)} must be [B, S] with the same B and S"
        )
        raise ValueError(msg)


def _check_scoring_args(logits_BSV: torch.Tensor, ids_BS: torch.Tensor, ids_name: str) -> None:
    check_logits_and_ids(logits_BSV, ids_BS, ids_name=ids_name)
    if not logits_BSV.is_floating_point():
        msg = f"logits dtype {logits_BSV.dtype} must be floating point"
        raise ValueError(msg)


def _chunked_logprobs(
    logits_BSV: torch.Tensor,
    targets_BT: torch.Tensor,
    sampling: Sampling,
    chunk_size: int | None,
    kernels: LogprobKernels,
) -> torch.Tensor:
    """Score logits at positions ``0..T-1`` against ``targets_BT`` (``T <= S``) chunk by chunk."""
    vocab_size = logits_BSV.shape[-1]
    _check_chunk_size(chunk_size)
    if sampling.filters_active:
        kernels = filtered_kernels(sampling)
    chunk = _positions_per_chunk(logits_BSV, chunk_size, kernels)
    targets_BT = targets_BT.to(device=logits_BSV.device, dtype=torch.int64)
    targets_BT = targets_BT.clamp(0, vocab_size - 1)  # pad ids: callers mask these positions
    # The full logits go in (not a [:, :-1] view): backward then writes one [B, S, V] gradient
    # instead of autograd zero-padding a sliced one.
    # autograd.Function.apply is untyped in torch's stubs
    result: Any = _ChunkedNextTokenLogprobs.apply(  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
        logits_BSV, targets_BT, sampling.temperature, chunk, kernels
    )
    assert isinstance(result, torch.Tensor)
    return result


def logprobs_with_leading_zero(next_BS1: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: a zero column, then ``next_BS1``; positions ``>= lengths_B[b]`` set to 0.

    Raises:
        ValueError: shapes disagree or a length is outside ``[0, S]``.
    """
    if next_BS1.dim() != 2 or lengths_B.shape != (next_BS1.shape[0],):
        msg = (
            f"next-token logprobs {tuple(next_BS1.shape)} must be [B, S-1] and lengths "
            f"{tuple(lengths_B.shape)} must be [B]"
        )
        raise ValueError(msg)
    seq_len = next_BS1.shape[1] + 1
    # checked where the lengths are (the host, for the worker) before they move: a check on the
    # device would wait for the whole forward before the last kernels are launched
    if bool((lengths_B < 0).any()) or bool((lengths_B > seq_len).any()):
        msg = f"input lengths {int_list(lengths_B)} must be in [0, S] = [0, {seq_len}]"
        raise ValueError(msg)
    lengths_B = lengths_B.to(next_BS1.device, non_blocking=True)
    full_BS = torch.cat([next_BS1.new_zeros((next_BS1.shape[0], 1)), next_BS1], dim=1)
    valid_BS = torch.arange(seq_len, device=next_BS1.device)[None, :] < lengths_B[:, None]
    return torch.where(valid_BS, full_BS, torch.zeros_like(full_BS))


def count_and_zero_neg_inf(
    logprobs: torch.Tensor, valid_mask: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``(clean, num_neg_inf)``: count ``-inf`` at valid positions; those and invalid ones become 0.

    A ``-inf`` at a valid position means the sampled token lies outside the trainer's top-k/top-p
    set (a policy/sampler mismatch the caller should warn about).
    """
    valid = valid_mask.to(device=logprobs.device, dtype=torch.bool)
    neg_inf = torch.isneginf(logprobs)
    num_neg_inf = int((neg_inf & valid).sum())
    clean = torch.where(valid & ~neg_inf, logprobs, torch.zeros_like(logprobs))
    return clean, num_neg_inf

"""Next-token logprobs: chunked fp32 log-softmax, vLLM-style filters, vocab-parallel partials.

Convention (API.md §4): ``logprobs[b, t] = log p(x_t | x_<t)`` for ``1 <= t < len_b``, column 0 is
0 and positions ``>= len_b`` are 0. Internally ``next_token_logprobs`` scores logits at positions
``0..S-2`` against targets ``token_ids[:, 1:]`` ([B, S-1]); ``logprobs_with_leading_zero`` turns
that into the [B, S] convention.

Memory ([better], API.md §4): ``next_token_logprobs`` is a custom autograd Function that saves
only the caller's (possibly bf16) logits and the targets. Forward and backward both work on one
chunk of sequence positions at a time (cast to fp32, divide by temperature, filter,
log-softmax, gather), so no fp32 ``[B, S, V]`` tensor is ever alive besides the caller's own
logits and their gradient (which have the logits' dtype: bf16 logits get a bf16 gradient).

Vocab parallel (STYLE.md §2.6): a rank holding the vocab slice ``vocab_range(rank, size, V)``
computes partials (``local_max``, ``local_sum_exp``, ``local_target_logit``,
``local_logprob_grad``); the shell all-reduces them (MAX, SUM, SUM) and ``logprobs_from_partials``
finishes. Pass these partials logits that are already fp32 and divided by the temperature.

Shape legend: ``B`` batch, ``S`` sequence, ``V`` vocab (or the local vocab shard), ``N`` rows.
All functions are pure: no communication, no device queries, inputs are never mutated.
"""

import math
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from policyworker.functional.packing import int_list

__all__ = [
    "apply_sampling_filters",
    "concat_vocab_pieces",
    "count_and_zero_neg_inf",
    "default_chunk_size",
    "local_logprob_grad",
    "local_max",
    "local_sum_exp",
    "local_target_logit",
    "logprobs_from_partials",
    "logprobs_with_leading_zero",
    "next_token_logprobs",
    "rows_for_rank",
    "sampling_filters_active",
    "sampling_keep_mask",
    "shifted_targets",
    "split_rows",
    "split_vocab",
    "target_logprobs",
    "vocab_range",
]

# default_chunk_size aims at this many bytes for one chunk's fp32 [chunk, V] block (batch 1).
_CHUNK_TARGET_BYTES = 128 * 1024 * 1024


# ----------------------------------------------------------------------------- argument checks


def _top_k_active(top_k: int | None, vocab_size: int) -> bool:
    """True when top-k removes something. None, 0 and -1 mean "disabled" (vLLM / NeMo-RL)."""
    if top_k is None or top_k in (0, -1):
        return False
    if top_k < -1:
        msg = f"top_k {top_k} must be a positive int, or None / 0 / -1 to disable top-k filtering"
        raise ValueError(msg)
    return top_k < vocab_size


def _check_top_p(top_p: float) -> None:
    if not 0.0 < top_p <= 1.0:
        msg = f"top_p {top_p} must be in (0, 1]; use 1.0 to disable top-p filtering"
        raise ValueError(msg)


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0.0):
        msg = f"temperature {temperature} must be a finite number > 0; use 1.0 for unscaled logits"
        raise ValueError(msg)


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


# ----------------------------------------------------------------------------- sampling filters


def sampling_filters_active(top_k: int | None, top_p: float) -> bool:
    """Whether `generation`'s top-k / top-p ask for any filtering (top_k of None, 0 or -1 and
    top_p of 1 mean none)."""
    return (top_k is not None and top_k > 0) or top_p < 1.0


def sampling_keep_mask(
    logits_NV: torch.Tensor, *, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor | None:
    """Bool mask (same shape) of the entries vLLM's sampler keeps, or None when nothing is filtered.

    top-k keeps every logit ``>=`` the k-th largest (ties with it are kept). top-p then works on
    the survivors: sort ascending, softmax, cumulative sum, remove entries whose cumsum
    ``<= 1 - top_p``, and always keep the largest. vLLM leaves the order of equal logits in that
    sort unspecified; here it is deterministic: among equal logits the higher vocab id is removed
    first, so the lowest-id maximum is always kept (the rule ``topk`` uses too). The mask is
    computed in fp32 and carries no gradient.
    """
    _check_top_p(top_p)
    vocab_size = logits_NV.shape[-1]
    use_k = _top_k_active(top_k, vocab_size)
    if not use_k and top_p >= 1.0:
        return None
    x = logits_NV.detach().float()
    keep = torch.ones_like(x, dtype=torch.bool)
    if use_k:
        assert top_k is not None
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        keep = x >= kth
    if top_p < 1.0:
        # Ascending sort with ties in *descending* id order (stable sort of the flipped row), so
        # equal logits are removed highest id first and the lowest-id maximum always survives.
        flipped = x.masked_fill(~keep, float("-inf")).flip(-1)
        sorted_x, flipped_order = torch.sort(flipped, dim=-1, stable=True)
        order = vocab_size - 1 - flipped_order
        cumulative = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        removed_sorted = cumulative <= 1.0 - top_p
        removed_sorted[..., -1] = False  # always keep the largest
        removed = torch.zeros_like(removed_sorted).scatter(-1, order, removed_sorted)
        keep = keep & ~removed
    return keep


def apply_sampling_filters(
    logits_NV: torch.Tensor, *, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """A new tensor: ``logits`` with ``-inf`` outside the vLLM top-k/top-p kept set (last dim).

    Gradient is straight-through on kept entries and zero on filtered ones. With no filter active
    the result is an equal copy.
    """
    keep = sampling_keep_mask(logits_NV, top_k=top_k, top_p=top_p)
    if keep is None:
        return logits_NV.clone()
    return logits_NV.masked_fill(~keep, float("-inf"))


# ----------------------------------------------------------------------------- chunked logprobs


def _scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    return x if temperature == 1.0 else x / temperature


def _chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


class _ChunkedNextTokenLogprobs(torch.autograd.Function):
    """(logits_BSV any float dtype, targets_BT with T <= S) -> fp32 [B, T], chunk by chunk.

    Saves only its two inputs; backward recomputes each chunk's filtered softmax.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        logits_BSV: torch.Tensor,
        targets_BT: torch.Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float,
        chunk_size: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(logits_BSV, targets_BT)
        ctx.settings = (temperature, top_k, top_p, chunk_size)  # type: ignore[attr-defined]
        num_positions = targets_BT.shape[1]
        out_BT = torch.empty(targets_BT.shape, dtype=torch.float32, device=logits_BSV.device)
        for start, stop in _chunk_bounds(num_positions, chunk_size):
            x = _scaled_fp32(logits_BSV[:, start:stop], temperature)
            keep = sampling_keep_mask(x, top_k=top_k, top_p=top_p)
            if keep is not None:
                x = x.masked_fill(~keep, float("-inf"))
            index = targets_BT[:, start:stop, None]
            out_BT[:, start:stop] = torch.log_softmax(x, dim=-1).gather(-1, index)[..., 0]
        return out_BT

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_BT: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        logits_BSV, targets_BT = ctx.saved_tensors
        temperature, top_k, top_p, chunk_size = ctx.settings
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        grad_BSV = torch.zeros_like(logits_BSV)
        for start, stop in _chunk_bounds(targets_BT.shape[1], chunk_size):
            x = _scaled_fp32(logits_BSV[:, start:stop], temperature)
            keep = sampling_keep_mask(x, top_k=top_k, top_p=top_p)
            if keep is not None:
                x = x.masked_fill(~keep, float("-inf"))
            g = grad_BT[:, start:stop, None].float()
            index = targets_BT[:, start:stop, None]
            target_weight = g if keep is None else g * keep.gather(-1, index)
            # d logprob[target] / d x = onehot(target) * keep - softmax(x); chain through 1/T.
            grad = (torch.softmax(x, dim=-1) * -g).scatter_add(-1, index, target_weight)
            if temperature != 1.0:
                grad = grad / temperature
            grad_BSV[:, start:stop] = grad.to(grad_BSV.dtype)
        return grad_BSV, None, None, None, None, None


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
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 ``[B, S-1]``: ``log_softmax(filter(logits[:, t] / T))[token_ids[:, t+1]]``.

    Equal to ``torch.log_softmax(apply_sampling_filters(logits.float() / T), -1).gather(...)`` but
    computed ``chunk_size`` sequence positions at a time (default ``default_chunk_size(V)``), in
    forward and in backward, so fp32 memory is bounded by one chunk. Target ids outside
    ``[0, V)`` (padding such as -1) are clamped for the gather and score a meaningless finite
    value: callers mask those positions. ``S == 1`` gives an empty ``[B, 0]`` result.

    Raises:
        ValueError: shapes disagree, or temperature/top_k/top_p/chunk_size is out of range.
    """
    _check_scoring_args(logits_BSV, token_ids_BS, "token_ids")
    return _chunked_logprobs(logits_BSV, token_ids_BS[:, 1:], temperature, top_k, top_p, chunk_size)


def target_logprobs(
    logits_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 ``[B, S]``: ``log_softmax(filter(logits[:, t] / T))[targets[:, t]]``, no shift.

    The same chunked autograd Function as ``next_token_logprobs``, for targets that are already
    aligned with the logits: a CP shard scored against ``shard_for_rank(shifted_targets(ids))``,
    or the row blocks of the tensor-parallel top-k/top-p path.

    Raises:
        ValueError: shapes disagree, or temperature/top_k/top_p/chunk_size is out of range.
    """
    _check_scoring_args(logits_BSV, targets_BS, "targets")
    return _chunked_logprobs(logits_BSV, targets_BS, temperature, top_k, top_p, chunk_size)


def _check_scoring_args(logits_BSV: torch.Tensor, ids_BS: torch.Tensor, ids_name: str) -> None:
    shapes_ok = logits_BSV.dim() == 3 and ids_BS.dim() == 2
    if not shapes_ok or logits_BSV.shape[:2] != ids_BS.shape:
        msg = (
            f"logits {tuple(logits_BSV.shape)} must be [B, S, V] and {ids_name} "
            f"{tuple(ids_BS.shape)} must be [B, S] with the same B and S"
        )
        raise ValueError(msg)
    if not logits_BSV.is_floating_point():
        msg = f"logits dtype {logits_BSV.dtype} must be floating point"
        raise ValueError(msg)


def _chunked_logprobs(
    logits_BSV: torch.Tensor,
    targets_BT: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float,
    chunk_size: int | None,
) -> torch.Tensor:
    """Score logits at positions ``0..T-1`` against ``targets_BT`` (``T <= S``) chunk by chunk."""
    _check_temperature(temperature)
    _check_top_p(top_p)
    vocab_size = logits_BSV.shape[-1]
    _top_k_active(top_k, vocab_size)
    _check_chunk_size(chunk_size)
    chunk = default_chunk_size(vocab_size) if chunk_size is None else chunk_size
    targets_BT = targets_BT.to(device=logits_BSV.device, dtype=torch.int64)
    targets_BT = targets_BT.clamp(0, vocab_size - 1)  # pad ids: callers mask these positions
    # The full logits go in (not a [:, :-1] view): backward then writes one [B, S, V] gradient
    # instead of autograd zero-padding a sliced one.
    # autograd.Function.apply is untyped in torch's stubs
    result: Any = _ChunkedNextTokenLogprobs.apply(  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
        logits_BSV, targets_BT, temperature, top_k, top_p, chunk
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
    lengths_B = lengths_B.to(next_BS1.device)
    if bool((lengths_B < 0).any()) or bool((lengths_B > seq_len).any()):
        msg = f"input lengths {int_list(lengths_B)} must be in [0, S] = [0, {seq_len}]"
        raise ValueError(msg)
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


# ----------------------------------------------------------------------------- vocab parallel


def vocab_range(rank: int, size: int, vocab_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the vocab ids held by ``rank`` of ``size``, as ``torch.chunk`` splits.

    This is the layout of a DTensor ``Shard(-1)``: every rank gets ``ceil(V / size)`` ids except
    the tail, which may be shorter or even empty (e.g. V=5, size=4 -> [0,2) [2,4) [4,5) [5,5)).
    """
    if size < 1 or not 0 <= rank < size:
        msg = f"rank {rank} must be in [0, size) with size {size} >= 1"
        raise ValueError(msg)
    if vocab_size < 0:
        msg = f"vocab_size {vocab_size} must be >= 0"
        raise ValueError(msg)
    per_rank = -(-vocab_size // size)
    return min(rank * per_rank, vocab_size), min((rank + 1) * per_rank, vocab_size)


def _accumulate(logits: torch.Tensor) -> torch.Tensor:
    # At least fp32 (bf16 logits are cast up), but never narrower than the input (float64 stays).
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def local_max(logits_BSV: torch.Tensor) -> torch.Tensor:
    """Max over the local vocab (``-inf`` for an empty shard); combine with all-reduce MAX.

    Vocab-parallel partials compute in ``promote_types(dtype, float32)``: fp32 for bf16/fp16/fp32
    logits, float64 for float64 logits.
    """
    x = _accumulate(logits_BSV)
    if x.shape[-1] == 0:
        return torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    return x.amax(dim=-1)


def local_sum_exp(logits_BSV: torch.Tensor, global_max_BS: torch.Tensor) -> torch.Tensor:
    """``sum(exp(x - global_max))`` over the local vocab; combine with all-reduce SUM."""
    return torch.exp(_accumulate(logits_BSV) - global_max_BS[..., None]).sum(dim=-1)


def _local_index(
    targets_BS: torch.Tensor, vocab_start: int, local_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    local_ids = targets_BS.to(torch.int64) - vocab_start
    owned = (local_ids >= 0) & (local_ids < local_size)
    return local_ids.clamp(0, max(local_size - 1, 0)), owned


def local_target_logit(
    logits_BSV: torch.Tensor, targets_BS: torch.Tensor, *, vocab_start: int
) -> torch.Tensor:
    """Logit of the target if this shard owns it, else 0 (so an all-reduce SUM selects it)."""
    x = _accumulate(logits_BSV)
    local_size = x.shape[-1]
    if local_size == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    index, owned = _local_index(targets_BS.to(x.device), vocab_start, local_size)
    picked = x.gather(-1, index[..., None])[..., 0]
    return torch.where(owned, picked, torch.zeros_like(picked))


def logprobs_from_partials(
    target_logit_BS: torch.Tensor, global_max_BS: torch.Tensor, global_sum_exp_BS: torch.Tensor
) -> torch.Tensor:
    """``target - max - log(sum_exp)``: the log-softmax of the target from the reduced partials."""
    return target_logit_BS - global_max_BS - torch.log(global_sum_exp_BS)


def local_logprob_grad(
    logits_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    vocab_start: int,
    global_max_BS: torch.Tensor,
    global_sum_exp_BS: torch.Tensor,
    grad_out_BS: torch.Tensor,
) -> torch.Tensor:
    """Gradient on the local vocab shard: ``(onehot_local(target) - softmax_local) * grad_out``.

    No communication is needed: ``global_max`` and ``global_sum_exp`` from the forward make the
    local softmax exact. The caller casts to the logits' dtype (and divides by the temperature if
    the logits were scaled).
    """
    x = _accumulate(logits_BSV)
    g = grad_out_BS.to(x.dtype)[..., None]
    grad = torch.exp(x - global_max_BS[..., None]) / global_sum_exp_BS[..., None] * -g
    local_size = x.shape[-1]
    if local_size == 0:
        return grad
    index, owned = _local_index(targets_BS.to(x.device), vocab_start, local_size)
    return grad.scatter_add(-1, index[..., None], g * owned[..., None].to(g.dtype))


def rows_for_rank(num_rows: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows ``rank`` filters in the TP top-k/top-p path (after all-to-all).

    The vocab-parallel ``[B*S, V/tp]`` logits are redistributed to row-parallel ``[B*S/tp, V]``,
    so the rows must split evenly.

    Raises:
        ValueError: ``num_rows % size != 0``; the fix is ``make_sequence_length_divisible_by``.
    """
    if size < 1 or not 0 <= rank < size:
        msg = f"rank {rank} must be in [0, size) with size {size} >= 1"
        raise ValueError(msg)
    if num_rows % size != 0:
        msg = (
            f"batch*sequence rows {num_rows} must be divisible by tensor_parallel_size {size} for "
            "top-k/top-p logprobs under tensor parallelism; set make_sequence_length_divisible_by "
            f"to a multiple of {size} (or use a batch size divisible by it)"
        )
        raise ValueError(msg)
    per_rank = num_rows // size
    return rank * per_rank, (rank + 1) * per_rank


def split_rows(x_NV: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Send list of the vocab->row all-to-all: piece ``r`` holds the rows of rank ``r``."""
    bounds = [rows_for_rank(x_NV.shape[0], r, size) for r in range(size)]
    return [x_NV[start:stop].contiguous() for start, stop in bounds]


def concat_vocab_pieces(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Receive side of the vocab->row all-to-all: rank-ordered vocab slices -> full-vocab rows."""
    return torch.cat(pieces, dim=-1)


def split_vocab(x_NV: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Send list of the row->vocab all-to-all (gradients back): piece ``r`` = ``vocab_range(r)``."""
    vocab_size = x_NV.shape[-1]
    ranges = [vocab_range(r, size, vocab_size) for r in range(size)]
    return [x_NV[..., start:stop].contiguous() for start, stop in ranges]

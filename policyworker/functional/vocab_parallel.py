"""Vocab-parallel logprobs: per-shard partials of a log-softmax, and the row/vocab all-to-all.

A tensor-parallel lm_head leaves each rank the vocab slice ``vocab_range(rank, size, V)``. That
rank computes partials (``local_max``, ``local_sum_exp``, ``local_target_logit``,
``local_logprob_grad``); the shell all-reduces them (MAX, SUM, SUM) and
``logprobs_from_partials`` finishes. The softmax's entropy has one more partial
(``local_sum_exp_centered``, SUM) and ``entropy_from_partials``. Pass these partials logits
that are already fp32 and divided by the temperature. Top-k/top-p need whole rows, so the
shell redistributes the ``[B*S, V/tp]`` shards to ``[B*S/tp, V]`` rows (``rows_for_rank``,
``split_rows``, ``concat_vocab_pieces``) and the gradients back (``split_vocab``).

Shape legend: ``B`` batch, ``S`` sequence, ``V`` vocab (or the local vocab shard), ``N`` rows.
All functions are pure: no communication, no device queries, inputs are never mutated.
"""

import torch

__all__ = [
    "concat_vocab_pieces",
    "entropy_from_partials",
    "local_logprob_grad",
    "local_max",
    "local_sum_exp",
    "local_sum_exp_centered",
    "local_target_logit",
    "logprobs_from_partials",
    "rows_for_rank",
    "split_rows",
    "split_vocab",
    "vocab_range",
]


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


def local_sum_exp_centered(logits_BSV: torch.Tensor, global_max_BS: torch.Tensor) -> torch.Tensor:
    """``sum(exp(x - global_max) * (x - global_max))`` over the local vocab (<= 0); combine with
    all-reduce SUM. Centred on the max so the entropy does not cancel large logits; a ``-inf``
    logit adds 0 (its probability is 0)."""
    centred = _accumulate(logits_BSV) - global_max_BS[..., None]
    weights = torch.exp(centred)
    return torch.where(weights > 0, weights * centred, torch.zeros_like(centred)).sum(dim=-1)


def entropy_from_partials(
    global_sum_exp_BS: torch.Tensor, global_sum_exp_centered_BS: torch.Tensor
) -> torch.Tensor:
    """``log(sum_exp) - sum_exp_centered / sum_exp``: the entropy ``-sum p log p`` of the
    softmax, from the reduced partials (both centred on the same global max)."""
    return torch.log(global_sum_exp_BS) - global_sum_exp_centered_BS / global_sum_exp_BS


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

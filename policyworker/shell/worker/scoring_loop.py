"""Next-token logprobs of a microbatch: plain or vocab-sharded logits, whole or chunk by chunk.

Training needs them differentiable from full logits; inference computes them without grad one
chunk of positions at a time, running the LM head per chunk so no [T, V] logits tensor exists.
Under tensor parallelism the logits are vocab-sharded DTensors, read by
`shell.parallel.collectives` without gathering the vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from policyworker.functional.logprobs import default_chunk_size
from policyworker.functional.sampling import Sampling
from policyworker.functional.tokens import counted_tokens
from policyworker.shell.model import hf_model as model_lib
from policyworker.shell.model.lora import LinearLoRA
from policyworker.shell.parallel import collectives
from policyworker.shell.worker.microbatches import Microbatch, forward, hidden_states
from policyworker.shell.worker.state import WorkerState

__all__ = [
    "filtering",
    "inference_chunk",
    "inference_scores",
    "logit_chunks",
    "logprobs_any",
    "rows_of_next",
    "sampling_for",
    "training_logprobs",
    "valid_mask",
]

_INFERENCE_CHUNK_TOKENS = 2048


def sampling_for(state: WorkerState, filtered: bool) -> Sampling:
    """The sampling filters logprobs are taken under (`filtered=False`: temperature only)."""
    return state.sampling if filtered else state.sampling.unfiltered()


def filtering(state: WorkerState) -> bool:
    """Whether top-k or top-p filtering is on (then filtered-out tokens get -inf logprobs)."""
    return state.sampling.filters_active


def valid_mask(data: Mapping[str, Any], seq_len: int) -> torch.Tensor:
    """[B, seq_len] bool: the tokens that count (`functional.tokens.counted_tokens`)."""
    return counted_tokens(
        data["input_lengths"], seq_len, data.get("token_mask"), data.get("sample_mask")
    )


def logprobs_any(
    state: WorkerState,
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    sampling: Sampling,
    chunk_size: int | None,
) -> torch.Tensor:
    """Next-token logprobs of plain or vocab-sharded (TP) logits (`state.logprob_kernels` score
    plain ones; `chunk_size` None: their default).

    Top-k/top-p under TP move whole rows between ranks, which needs `rows * positions`
    divisible by tp; otherwise this block's logits are gathered over the vocab first (one
    [rows, positions, V] block, differentiable) and scored as plain logits.
    """
    if (
        isinstance(logits, DTensor)
        and sampling.filters_active
        and ids.numel() % state.parallel.tp_size != 0
    ):
        logits = logits.full_tensor()
    return collectives.next_token_logprobs_any(
        logits,
        ids,
        state.parallel,
        sampling=sampling,
        chunk_size=chunk_size,
        kernels=state.logprob_kernels,
    )


def rows_of_next(mb: Microbatch, lp: torch.Tensor) -> torch.Tensor:
    """Model-row next-token values [b or 1, T-1] -> [b, w-1] per sequence."""
    if not mb.packed:
        return lp
    full_1N = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    return mb.unpack_rows(full_1N)[:, 1:]


def training_logprobs(
    state: WorkerState, mb: Microbatch, logits: torch.Tensor, *, filtered: bool
) -> torch.Tensor:
    """[b, w-1] next-token logprobs of microbatch `mb` from its logits (differentiable)."""
    lp = logprobs_any(
        state,
        logits,
        mb.input_ids,
        sampling=sampling_for(state, filtered),
        chunk_size=state.cfg.logprob_chunk_size,
    )
    return rows_of_next(mb, lp)


def logit_chunks(
    state: WorkerState, mb: Microbatch
) -> tuple[Callable[[int, int], torch.Tensor], int, int]:
    """(logits_at(start, stop), num_positions, vocab) for no-grad inference.

    For plain causal LMs only the hidden states are kept and the LM head runs one chunk of
    positions at a time, so no [T, V] logits tensor exists; other heads use full logits, and
    so does sequence parallelism (its hidden states are sharded on the sequence). Under TP
    each chunk's logits are a vocab-sharded DTensor.
    """
    sequence_sharded = state.cfg.dtensor_cfg.sequence_parallel and state.parallel.tp_size > 1
    if model_lib.supports_chunked_lm_head(state.model) and not sequence_sharded:
        hidden = hidden_states(state, mb)
        # Any: get_output_embeddings is a Hugging Face method, not on torch's nn.Module.
        head = cast(Any, state.model).get_output_embeddings()

        weight_and_bias = _head_in_compute_dtype(head, state.dtype)

        def logits_at(start: int, stop: int) -> torch.Tensor:
            if weight_and_bias is not None:
                weight, bias = weight_and_bias
                return F.linear(hidden[:, start:stop].to(weight.dtype), weight, bias)
            with model_lib.autocast_context(state.device, state.dtype):
                return head(hidden[:, start:stop])

        return logits_at, hidden.shape[1], int(head.weight.shape[0])
    logits = forward(state, mb)
    return (lambda start, stop: logits[:, start:stop]), logits.shape[1], logits.shape[-1]


def _head_in_compute_dtype(
    head: torch.nn.Module, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A plain linear head's weight and bias cast to the autocast `dtype` once, for every chunk
    of one microbatch: autocast would cast the whole [V, H] weight again per chunk (1.4 GB of
    traffic per chunk for a 1.5B model's fp32 head). A LoRA head gives its merged weight (the
    one its forward uses) once. None where the head is not a plain `nn.Linear` on plain tensors,
    or no cast happens: those chunks run the head under autocast."""
    if isinstance(head, LinearLoRA):
        return None if dtype == torch.float32 else head.merged_weights(dtype)
    if (
        type(head) is not torch.nn.Linear
        or dtype == torch.float32
        or isinstance(head.weight, DTensor)
        or head.weight.dtype == dtype
    ):
        return None
    bias = None if head.bias is None else head.bias.to(dtype)
    return head.weight.to(dtype), bias


def inference_chunk(state: WorkerState, vocab: int, *, rows: int) -> int:
    """Positions per LM-head chunk: `logprob_chunk_size`, else about 2048 tokens per chunk
    (big enough for an efficient head GEMM, at most ~14 bytes * 2048 * V of scratch)."""
    if state.cfg.logprob_chunk_size:
        return state.cfg.logprob_chunk_size
    return max(default_chunk_size(vocab), -(-_INFERENCE_CHUNK_TOKENS // max(rows, 1)))


def inference_scores(
    state: WorkerState,
    mb: Microbatch,
    *,
    logprobs: bool = True,
    entropy: bool = False,
    top_k: int = 0,
) -> dict[str, torch.Tensor]:
    """One no-grad pass over the LM head, a chunk of positions at a time, for any of:

    - ``"logprobs"`` [b, w-1]: next-token logprobs under the worker's sampling filters;
    - ``"entropy"`` [b, w-1]: the entropy of ``softmax(logits / T)`` of the same next-token
      distributions, in nats (sampling filters do not apply, as for top-k);
    - ``"topk_logits"`` / ``"topk_indices"`` [b, w, k]: the exact top-k of ``logits / T`` at
      every position (no shift), k at most the vocab.

    Each chunk's logits are made once and read by every statistic asked for: adding entropy or
    top-k to logprobs costs no second forward or LM-head pass.
    """
    logits_at, num_positions, vocab = logit_chunks(state, mb)
    chunk = inference_chunk(state, vocab, rows=mb.input_ids.shape[0])
    temperature, k = state.sampling.temperature, min(top_k, vocab)
    rows = mb.input_ids.shape[0]
    parts: dict[str, list[torch.Tensor]] = {}
    if logprobs:
        parts["logprobs"] = [torch.zeros(rows, 0, device=state.device)]
    if entropy:
        parts["entropy"] = [torch.zeros(rows, 0, device=state.device)]
    if k:
        parts["topk_logits"] = [torch.zeros(rows, 0, k, device=state.device)]
        parts["topk_indices"] = [torch.zeros(rows, 0, k, dtype=torch.int64, device=state.device)]
    # Top-k scores every position, the next-token statistics all but the last. A chunk's logits
    # reach one position further (the next chunk's first), whose token is the chunk's last
    # target: the same LM-head shapes whichever statistics are asked for, so each gives the
    # same bits alone or together.
    scored = num_positions if k else num_positions - 1
    for start in range(0, scored, chunk):
        stop = min(start + chunk, scored)
        logits = logits_at(start, min(stop + 1, num_positions))
        num_next = min(stop, num_positions - 1) - start  # next-token positions in this chunk
        if logprobs and num_next > 0:
            parts["logprobs"].append(
                logprobs_any(
                    state,
                    _first(logits, num_next + 1),
                    mb.input_ids[:, start : start + num_next + 1],
                    sampling=state.sampling,
                    chunk_size=chunk,
                )
            )
        if entropy and num_next > 0:
            parts["entropy"].append(
                collectives.entropy_any(
                    _first(logits, num_next),
                    temperature=temperature,
                    kernels=state.logprob_kernels,
                )
            )
        if k:
            values, ids = collectives.topk_any(
                _first(logits, stop - start), k, temperature=temperature
            )
            parts["topk_logits"].append(values)
            parts["topk_indices"].append(ids)
    out = {key: torch.cat(chunks, dim=1) for key, chunks in parts.items()}
    for key in ("logprobs", "entropy"):
        if key in out:
            out[key] = rows_of_next(mb, out[key])
    for key in ("topk_logits", "topk_indices"):
        if key in out:
            out[key] = mb.unpack_rows(out[key])
    return out


def _first(logits: torch.Tensor, positions: int) -> torch.Tensor:
    """The first `positions` positions of a chunk's logits (the chunk itself when it has no
    more, so a vocab-sharded chunk is passed on as it is)."""
    return logits if logits.shape[1] == positions else logits[:, :positions]

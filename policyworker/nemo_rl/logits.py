"""NeMo-RL's names for turning logits into what a loss reads: `TrainingSamplingParams`,
`apply_top_k_top_p`, `get_next_token_logprobs_from_logits` and `prepare_loss_input`, over
`policyworker.functional` (`Sampling`, `sampling_keep_mask`, `next_token_logprobs`,
`distillation_loss_input`). Single-process only: the process-group arguments are accepted and
must be None (the worker handles its own tensor parallelism)."""

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from policyworker.functional.distillation import distillation_loss_input
from policyworker.functional.logprobs import count_and_zero_neg_inf, next_token_logprobs
from policyworker.functional.loss import LossInputType
from policyworker.functional.loss_protocol import input_type_of
from policyworker.functional.sampling import Sampling, sampling_filters_active, sampling_keep_mask

__all__ = [
    "TOP_K_TOP_P_CHUNK_SIZE",
    "TrainingSamplingParams",
    "apply_top_k_top_p",
    "get_next_token_logprobs_from_logits",
    "need_top_k_or_top_p_filtering",
    "prepare_loss_input",
]

TOP_K_TOP_P_CHUNK_SIZE = 256


@dataclass
class TrainingSamplingParams:
    """The generation's top-k (None or -1: off), top-p (1.0: off) and temperature."""

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


def need_top_k_or_top_p_filtering(sampling_params: TrainingSamplingParams | None) -> bool:
    """Whether `sampling_params` filter any token."""
    if sampling_params is None:
        return False
    return sampling_filters_active(sampling_params.top_k, sampling_params.top_p)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: int | None,
    top_p: float,
    chunk_size: int | None = TOP_K_TOP_P_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`logits` with -inf outside the vLLM top-k/top-p set, the bool keep mask), or
    (`logits`, None) when nothing is filtered. `chunk_size` is accepted; the mask is computed
    at once. Gradient flows through kept entries only."""
    del chunk_size
    keep = sampling_keep_mask(logits, top_k=top_k, top_p=top_p)
    if keep is None:
        return logits, None
    return logits.masked_fill(~keep, float("-inf")), keep


def _single_process(**groups: Any) -> None:
    given = [name for name, value in groups.items() if value is not None]
    if given:
        msg = (
            f"{', '.join(given)} given: this face scores logits in one process; pass None and "
            "let PolicyWorker handle tensor/context parallelism"
        )
        raise NotImplementedError(msg)


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: torch.Tensor | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 [B, S-1]: the log-probability of each next token under the top-k/top-p filtered
    softmax of `next_token_logits` [B, S, V] (temperature is the caller's, as in NeMo-RL)."""
    del seq_index, vocab_parallel_rank
    _single_process(
        vocab_parallel_group=vocab_parallel_group, context_parallel_group=context_parallel_group
    )
    full = getattr(next_token_logits, "full_tensor", None)  # a DTensor: score the whole vocab
    logits = cast(torch.Tensor, full()) if callable(full) else next_token_logits
    sampling = Sampling(
        top_k=None if sampling_params is None else sampling_params.top_k,
        top_p=1.0 if sampling_params is None else sampling_params.top_p,
    )
    return next_token_logprobs(
        logits, input_ids.to(logits.device), sampling=sampling, chunk_size=chunk_size
    )


def prepare_loss_input(
    logits: torch.Tensor,
    data: MutableMapping[str, Any],
    loss_fn: Any,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    d2t: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """(the keyword inputs of `loss_fn` by its `input_type`, `data`). With top-k/top-p active
    the LOGPROB input has its filtered-out tokens zeroed and, for a loss with a reference KL
    penalty, `data["curr_logprobs_unfiltered"]` is added.

    Raises:
        ValueError: an input type other than LOGPROB, LOGIT or DISTILLATION.
    """
    del vocab_parallel_rank, d2t
    _single_process(
        vocab_parallel_group=vocab_parallel_group, context_parallel_group=context_parallel_group
    )
    kind = input_type_of(loss_fn)
    if kind == LossInputType.LOGIT:
        return {"logits": logits}, data
    if kind == LossInputType.DISTILLATION:
        return dict(distillation_loss_input(logits, data, loss_fn)), data
    input_ids = data["input_ids"]
    logprobs = get_next_token_logprobs_from_logits(
        input_ids, logits, sampling_params=sampling_params, chunk_size=chunk_size
    )
    if need_top_k_or_top_p_filtering(sampling_params):
        mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
        logprobs, _ = count_and_zero_neg_inf(logprobs, mask[:, 1:])
        if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
            data["curr_logprobs_unfiltered"] = get_next_token_logprobs_from_logits(
                input_ids, logits
            )
    return {"next_token_logprobs": logprobs}, data

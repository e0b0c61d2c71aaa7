"""Distributed logprobs, top-k, CP gather and grad norm: core partials + collectives.

One import for the collectives over shards; they live in `vocab_logprobs` (TP logprobs, with
and without top-k/top-p, and the softmax's entropy), `topk`, `context_parallel` and `grads`
(norm and clipping).

The math lives in `policyworker.functional.logprobs` / `.topk` / `.context_parallel`; this module
only issues the all-reduces / all-gathers / all-to-alls between the core calls. Every group used
here comes from `ParallelContext` (or a DTensor's mesh built by it), whose timeout bounds each
collective.

Shape legend: B batch, S sequence (S_local a CP shard), V vocab, V_local a TP vocab shard,
N rows (B*S flattened), K top-k.

Gradient convention: outputs that are replicated over a group (vocab-parallel logprobs, rows
gathered after top-k/top-p filtering) receive the same upstream gradient on every rank, and each
rank returns the gradient of its own shard without a reduction; this is what makes a loss
computed identically on every TP rank give the single-process gradient. `all_gather_cp` differs:
its backward all-reduces the gradient over CP (SUM), then keeps this rank's chunks.
"""

from policyworker.shell.parallel.context_parallel import (
    all_gather_cp,
    context_parallel_forward,
    cp_next_token_logprobs,
)
from policyworker.shell.parallel.grads import clip_grads_, total_grad_norm
from policyworker.shell.parallel.topk import distributed_topk, topk_any
from policyworker.shell.parallel.vocab_logprobs import (
    entropy_any,
    next_token_logprobs_any,
    target_logprobs_any,
    vocab_parallel_next_token_logprobs,
    vocab_parallel_target_logprobs,
)

__all__ = [
    "all_gather_cp",
    "clip_grads_",
    "context_parallel_forward",
    "cp_next_token_logprobs",
    "distributed_topk",
    "entropy_any",
    "next_token_logprobs_any",
    "target_logprobs_any",
    "topk_any",
    "total_grad_norm",
    "vocab_parallel_next_token_logprobs",
    "vocab_parallel_target_logprobs",
]

"""Parallelism: this rank's place in the process group and what runs across it.

context.py          ParallelContext: dp/cp/tp sizes, coordinates, groups, device, reductions
agreed_checks.py    checks whose refusal on one rank raises on every rank, before collectives
plans.py            FSDP2 + tensor-parallel plans, activation checkpointing, reshard
collectives.py      one import for the collectives over shards, which live in:
  vocab_logprobs.py   logprobs of vocab-sharded logits (with top-k/top-p: rows exchanged)
  topk.py             exact top-k over vocab shards
  context_parallel.py the sequence over CP ranks: forward, gathers, logprobs
  grads.py            grad norm and clipping of sharded parameters
  groups.py           the group helpers they share
"""

from policyworker._lazy import lazy_exports

# The names other code imports from this face, each resolved on first use
__getattr__, __all__ = lazy_exports(  # pyright: ignore[reportUnsupportedDunderAll]
    __name__,
    {
        "ParallelContext": "policyworker.shell.parallel.context",
        "clip_grads_": "policyworker.shell.parallel.collectives",
        "next_token_logprobs_any": "policyworker.shell.parallel.collectives",
        "parallelize_model": "policyworker.shell.parallel.plans",
        "total_grad_norm": "policyworker.shell.parallel.collectives",
    },
)

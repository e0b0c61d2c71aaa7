"""Parallelism: this rank's place in the process group and what runs across it.

    context.py      ParallelContext: dp/cp/tp sizes, coordinates, groups, device, reductions
    plans.py        FSDP2 + tensor-parallel plans, activation checkpointing, reshard
    collectives.py  one import for the collectives over shards, which live in:
      vocab_logprobs.py   logprobs of vocab-sharded logits (with top-k/top-p: rows exchanged)
      topk.py             exact top-k over vocab shards
      context_parallel.py the sequence over CP ranks: forward, gathers, logprobs
      grads.py            grad norm and clipping of sharded parameters
      groups.py           the group helpers they share

`policyworker.shell.parallel` was once the plans module: its names stay importable from here.
"""

from typing import Any

_PLAN_NAMES = (
    "SUPPORTED_TP_MODEL_TYPES",
    "TP_STYLE_NAMES",
    "apply_activation_checkpointing",
    "check_tp_divisibility",
    "decoder_layers",
    "move_buffers",
    "parallelize_model",
    "reshard",
    "tensor_parallel_plan",
)


def __getattr__(name: str) -> Any:
    if name in _PLAN_NAMES:
        from policyworker.shell.parallel import plans

        return getattr(plans, name)
    msg = f"module 'policyworker.shell.parallel' has no attribute {name!r}"
    raise AttributeError(msg)

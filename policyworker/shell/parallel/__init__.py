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

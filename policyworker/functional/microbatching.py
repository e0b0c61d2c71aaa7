"""Microbatch planning of one rank: which planner a config picks, and with which token budget.

Fixed microbatches of `mbs` rows unless the config enables dynamic batching (a token budget per
microbatch) or sequence packing (bins of whole sequences); training and logprob passes have
their own budgets. The shell adds dummy microbatches so all ranks run the same count.
"""

from typing import Literal

import torch

from policyworker.config import PolicyConfig
from policyworker.functional import batching

__all__ = ["plan_microbatches"]


def plan_microbatches(
    cfg: PolicyConfig,
    lengths_B: torch.Tensor,
    *,
    seq_len: int,
    mbs: int,
    purpose: Literal["train", "logprob"],
) -> list[batching.MicrobatchPlan]:
    """This rank's fixed / dynamic / packed microbatch plans for rows of `lengths_B`."""
    if cfg.dynamic_batching is not None:
        dyn = cfg.dynamic_batching
        budget = dyn.train_mb_tokens if purpose == "train" else dyn.logprob_tokens
        return batching.dynamic_microbatches(
            lengths_B,
            max_tokens=budget,
            seq_len=seq_len,
            sequence_length_round=dyn.sequence_length_round,
        )
    if cfg.sequence_packing is not None:
        sp = cfg.sequence_packing
        budget = sp.train_mb_tokens if purpose == "train" else sp.logprob_tokens
        return batching.packed_microbatches(
            lengths_B,
            capacity=budget,
            algorithm=sp.algorithm,
            pad_multiple=cfg.make_sequence_length_divisible_by,
        )
    return batching.fixed_microbatches(int(lengths_B.shape[0]), mbs, seq_len=seq_len)

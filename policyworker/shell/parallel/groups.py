"""The two group helpers every collective here shares: an all-reduce that is the identity
without a group, and the size of a group (1 without one)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []  # helpers of the modules of this package only


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: Any) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)

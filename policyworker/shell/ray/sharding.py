"""The rows of a group call split over the data-parallel ranks, and the way back.

`BatchedDataDict.shard_by_batch_size` does the split (one global batch at a time, as NeMo-RL
does); the same split of the row numbers 0..B-1 says which of the caller's rows each shard
holds, so results come back in the caller's row order and a refused shard names its rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from policyworker.data import BatchedDataDict

__all__ = ["split_over_dp"]


def split_over_dp(
    data: Mapping[str, Any], *, dp_size: int, batch_size: int | None
) -> tuple[list[BatchedDataDict], list[torch.Tensor]]:
    """`data` cut into `dp_size` shards (per global batch of `batch_size` rows; None: all rows,
    uneven shards allowed) and each shard's rows of `data`; refused when a shard is empty."""
    batch = BatchedDataDict(data)
    size, uneven = batch.size, batch_size is None
    # Without dynamic batching or packing arguments it returns the plain list of shards.
    shards = cast(
        "list[BatchedDataDict]",
        batch.shard_by_batch_size(dp_size, batch_size, allow_uneven_shards=uneven),
    )
    rows = cast(
        "list[BatchedDataDict]",
        BatchedDataDict(rows=torch.arange(size)).shard_by_batch_size(
            dp_size, batch_size, allow_uneven_shards=uneven
        ),
    )
    if any(shard.size == 0 for shard in shards):
        msg = (
            f"data has {size} rows: split over {dp_size} data-parallel ranks "
            f"(ceil({size} / {dp_size}) each) some rank gets none; pass a multiple "
            f"of {dp_size} rows"
        )
        raise ValueError(msg)
    return shards, [r["rows"] for r in rows]

"""RayWorkerGroup calls that take a data-plane receipt instead of a batch.

The driver (or the rollout side) puts the batch into the data plane once and holds only its
receipt (`KVBatchMeta`); each call here sends every rank the receipt of its dp rank's rows (the
same rows the plain group call would send it: `split_over_dp` of the row numbers), the ranks
fetch their rows themselves, and logprob results stay in the data plane as fields, read back by
key with `read_fields`. What crosses the driver is receipts: keys, lengths and field names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.functional.receipts import KVBatchMeta
from policyworker.shell.data_plane.client import DataPlaneClient
from policyworker.shell.ray.group import RayWorkerGroup
from policyworker.shell.ray.sharding import split_over_dp

__all__ = [
    "abort_train_step_presharded",
    "begin_train_step_presharded",
    "finish_train_step_presharded",
    "get_logprobs_presharded",
    "get_reference_policy_logprobs_presharded",
    "rank_receipts",
    "read_fields",
    "setup_data_plane",
    "train_microbatch_presharded",
    "train_presharded",
]


def rank_receipts(
    group: RayWorkerGroup, meta: KVBatchMeta, *, batch_size: int | None
) -> list[KVBatchMeta]:
    """One receipt per rank (the ranks of one dp rank share theirs), split as the plain call
    splits a batch of `meta.size` rows."""
    _, rows = split_over_dp(
        {"rows": torch.arange(meta.size)}, dp_size=group.dp_size, batch_size=batch_size
    )
    block = group.world_size // group.dp_size
    return [meta.subset(rows[r // block].tolist()) for r in range(group.world_size)]


def _per_rank(
    group: RayWorkerGroup,
    method: str,
    receipts: Sequence[KVBatchMeta],
    kwargs: Mapping[str, Any],
) -> list[Any]:
    return group._call(method, [((m,), dict(kwargs)) for m in receipts])


def setup_data_plane(group: RayWorkerGroup, cfg: Mapping[str, Any] | Any = None) -> None:
    """`PolicyWorker.setup_data_plane(cfg)` on every rank (attach to the running data plane)."""
    group.run("setup_data_plane", cfg)


def train_presharded(
    group: RayWorkerGroup,
    meta: KVBatchMeta,
    loss_fn: Any,
    eval_mode: bool = False,
    gbs: int | None = None,
    mbs: int | None = None,
) -> dict[str, Any]:
    """`train` on the rows of `meta`, each rank fetching its own; rank 0's result."""
    gbs = gbs or group.cfg.train_global_batch_size
    receipts = rank_receipts(group, meta, batch_size=gbs)
    kwargs = {"loss_fn": loss_fn, "eval_mode": eval_mode, "gbs": gbs, "mbs": mbs}
    return _per_rank(group, "train_presharded", receipts, kwargs)[0]


def get_logprobs_presharded(
    group: RayWorkerGroup, meta: KVBatchMeta, micro_batch_size: int | None = None
) -> KVBatchMeta:
    """Logprobs of the rows of `meta`, written back as `prev_logprobs`; the receipt to read
    them by (`read_fields(client, receipt)`)."""
    receipts = rank_receipts(group, meta, batch_size=None)
    _per_rank(group, "get_logprobs_presharded", receipts, {"micro_batch_size": micro_batch_size})
    return meta.with_fields(["prev_logprobs"])


def get_reference_policy_logprobs_presharded(
    group: RayWorkerGroup, meta: KVBatchMeta, micro_batch_size: int | None = None
) -> KVBatchMeta:
    """Reference logprobs of the rows of `meta`, written back as `reference_policy_logprobs`."""
    receipts = rank_receipts(group, meta, batch_size=None)
    _per_rank(
        group,
        "get_reference_policy_logprobs_presharded",
        receipts,
        {"micro_batch_size": micro_batch_size},
    )
    return meta.with_fields(["reference_policy_logprobs"])


def begin_train_step_presharded(
    group: RayWorkerGroup, loss_fn: Any, gbs: int | None = None, mbs: int | None = None
) -> None:
    """Open a split train step on every rank (nothing is fetched or stepped)."""
    group.run("begin_train_step_presharded", loss_fn, gbs=gbs, mbs=mbs)


def train_microbatch_presharded(group: RayWorkerGroup, meta: KVBatchMeta) -> None:
    """Forward and backward on the rows of `meta` (a piece of the step's global batch, split
    over dp as a plain call splits it), each rank fetching its own; nothing returned."""
    _per_rank(group, "train_microbatch_presharded", rank_receipts(group, meta, batch_size=None), {})


def finish_train_step_presharded(group: RayWorkerGroup) -> dict[str, Any]:
    """Close the open step on every rank (one optimizer step): rank 0's result, with
    `all_mb_metrics` of every dp rank (dp order, one replica-group leader each), as `train`."""
    parts = [r for r in group.run("finish_train_step_presharded") if r["is_replica_leader"]]
    keys = dict.fromkeys(k for part in parts for k in part["all_mb_metrics"])
    metrics = {k: [v for part in parts for v in part["all_mb_metrics"].get(k, [])] for k in keys}
    return {**parts[0], "all_mb_metrics": metrics}


def abort_train_step_presharded(group: RayWorkerGroup) -> None:
    """Drop the open step on every rank without an optimizer step."""
    group.run("abort_train_step_presharded")


def read_fields(
    client: DataPlaneClient, meta: KVBatchMeta, fields: Sequence[str]
) -> dict[str, torch.Tensor]:
    """`fields` of the rows of `meta`, in its row order (a read by key from the data plane)."""
    return client.get_samples(meta.sample_ids, meta.partition_id, list(fields))

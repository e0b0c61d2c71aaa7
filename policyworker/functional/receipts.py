"""Data-plane receipts: which rows a rank fetches, and who fetches them (pure).

A receipt (`KVBatchMeta`, NeMo-RL's name and attribute names) travels through the driver in place
of the batch: the partition, the sample keys, the fields to read, each row's sequence length.
A rank fetches its rows by key from the data plane. Everything here is arithmetic on receipts:
checking one, cutting a batch receipt into data-parallel shards, planning a replica group's fetch
and describing tensors for a broadcast without pickling them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from attrs import field, frozen

__all__ = [
    "FETCH_POLICIES",
    "FetchPlan",
    "KVBatchMeta",
    "TensorEntry",
    "common_prefix",
    "describe_tensors",
    "empty_like_entries",
    "missing",
    "plan_fetch",
    "receipt_problems",
    "shard_receipt",
    "stack_rows",
]

FetchPolicy = Literal["auto", "independent", "leader_broadcast"]
FETCH_POLICIES: tuple[str, ...] = ("auto", "independent", "leader_broadcast")


def _as_str_tuple(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(values)


def _opt_int_tuple(values: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)


def _opt_str_tuple(values: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if values is None else tuple(values)


@frozen(kw_only=True)
class KVBatchMeta:
    """A receipt for rows held by the data plane (small: keys and lengths, no tensors).

    `sample_ids` address the rows in `partition_id`; `fields` are the columns a consumer reads
    (None: the consumer must name them); `sequence_lengths` (one per row) let the driver shard
    by tokens without reading a tensor; `extra_info` carries small driver-side notes.
    """

    partition_id: str
    sample_ids: tuple[str, ...] = field(converter=_as_str_tuple)
    task_name: str | None = None
    fields: tuple[str, ...] | None = field(default=None, converter=_opt_str_tuple)
    sequence_lengths: tuple[int, ...] | None = field(default=None, converter=_opt_int_tuple)
    extra_info: Mapping[str, Any] = field(factory=lambda: dict[str, Any]())

    def __attrs_post_init__(self) -> None:
        problems = receipt_problems(self)
        if problems:
            raise ValueError("bad KVBatchMeta: " + "; ".join(problems))

    @property
    def size(self) -> int:
        """The number of rows."""
        return len(self.sample_ids)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A receipt crosses the driver once per rank per call: pickle it as a positional
        # tuple, its keys as their common prefix and the rest of each (keys are usually
        # "<partition>-<n>"), not as attribute names and whole keys.
        prefix = common_prefix(self.sample_ids)
        return _receipt_from_wire, (
            self.partition_id,
            prefix,
            tuple(k[len(prefix) :] for k in self.sample_ids),
            self.task_name,
            self.fields,
            self.sequence_lengths,
            dict(self.extra_info) or None,
        )

    def subset(self, indices: Sequence[int]) -> KVBatchMeta:
        """The receipt of the rows at `indices` (in that order)."""
        lengths = self.sequence_lengths
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=[self.sample_ids[i] for i in indices],
            fields=self.fields,
            sequence_lengths=None if lengths is None else [lengths[i] for i in indices],
            extra_info=dict(self.extra_info),
        )

    def with_fields(self, names: Sequence[str]) -> KVBatchMeta:
        """The same rows with `names` added to `fields` (order kept, no duplicates)."""
        merged = tuple(dict.fromkeys([*(self.fields or ()), *names]))
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=self.sample_ids,
            fields=merged,
            sequence_lengths=self.sequence_lengths,
            extra_info=dict(self.extra_info),
        )


def _receipt_from_wire(
    partition_id: str,
    prefix: str,
    suffixes: tuple[str, ...],
    task_name: str | None,
    fields: tuple[str, ...] | None,
    sequence_lengths: tuple[int, ...] | None,
    extra_info: Mapping[str, Any] | None,
) -> KVBatchMeta:
    """The receipt `KVBatchMeta.__reduce__` pickled."""
    return KVBatchMeta(
        partition_id=partition_id,
        sample_ids=[prefix + s for s in suffixes],
        task_name=task_name,
        fields=fields,
        sequence_lengths=sequence_lengths,
        extra_info=dict(extra_info or {}),
    )


def common_prefix(keys: Sequence[str]) -> str:
    """The longest string every key starts with ("" for no keys)."""
    if not keys:
        return ""
    low, high = min(keys), max(keys)  # the prefix of these two is everyone's
    n = 0
    while n < min(len(low), len(high)) and low[n] == high[n]:
        n += 1
    return low[:n]


def receipt_problems(meta: KVBatchMeta) -> list[str]:
    """What is wrong with a receipt on its own (empty: nothing), each naming key and fix."""
    problems: list[str] = []
    if not meta.partition_id:
        problems.append("partition_id is empty: name the partition the rows were put in")
    duplicated = sorted({k for k in meta.sample_ids if meta.sample_ids.count(k) > 1})
    if duplicated:
        problems.append(f"sample_ids repeat {duplicated}: each row has one key")
    if any(not k for k in meta.sample_ids):
        problems.append("sample_ids holds an empty key")
    lengths = meta.sequence_lengths
    if lengths is not None and len(lengths) != len(meta.sample_ids):
        problems.append(
            f"sequence_lengths has {len(lengths)} entries for {len(meta.sample_ids)} "
            "sample_ids: give one length per row"
        )
    if lengths is not None and any(n < 0 for n in lengths):
        problems.append("sequence_lengths holds a negative length")
    if meta.fields is not None and len(set(meta.fields)) != len(meta.fields):
        problems.append(f"fields repeat a name: {list(meta.fields)}")
    return problems


def missing(wanted: Sequence[str], present: Sequence[str]) -> tuple[str, ...]:
    """The names of `wanted` not in `present`, in `wanted`'s order, once each."""
    have = set(present)
    return tuple(dict.fromkeys(w for w in wanted if w not in have))


def shard_receipt(meta: KVBatchMeta, *, dp_size: int, dp_rank: int) -> KVBatchMeta:
    """Data-parallel rank `dp_rank`'s contiguous share of a batch receipt.

    The rows split into `dp_size` equal contiguous shards, the order `RayWorkerGroup` shards a
    batch in, so a presharded call sees the same rows as the plain call it replaces.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not a rank of dp_size={dp_size}")
    if meta.size % dp_size:
        raise ValueError(
            f"the receipt holds {meta.size} rows, not a multiple of dp_size={dp_size}: "
            "put a batch every data-parallel rank gets the same number of rows of"
        )
    per = meta.size // dp_size
    return meta.subset(range(dp_rank * per, (dp_rank + 1) * per))


@frozen
class FetchPlan:
    """What one rank of a replica group does: fetch from the data plane, and/or take part in a
    broadcast from the group's leader."""

    fetch: bool
    broadcast: bool


def plan_fetch(policy: str, *, group_size: int, is_leader: bool) -> FetchPlan:
    """The fetch of one rank under `policy` in a replica group of `group_size` ranks."""
    if policy not in FETCH_POLICIES:
        raise ValueError(f"fetch_policy={policy!r}: use one of {list(FETCH_POLICIES)}")
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: a replica group holds at least this rank")
    if policy == "leader_broadcast" and group_size == 1:
        raise ValueError(
            "fetch_policy='leader_broadcast' needs a replica group of more than one rank "
            "(tp x cp > 1); use 'auto' or 'independent' here"
        )
    if policy == "independent" or group_size == 1:
        return FetchPlan(fetch=True, broadcast=False)
    return FetchPlan(fetch=is_leader, broadcast=True)


@frozen
class TensorEntry:
    """One tensor of a broadcast: its name, dtype name and shape (the descriptor's rows)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def describe_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorEntry, ...]:
    """The descriptor that precedes a broadcast of `tensors`: names, dtypes, shapes (sorted)."""
    return tuple(
        TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in sorted(tensors.items())
    )


def empty_like_entries(
    entries: Sequence[TensorEntry], *, device: torch.device
) -> dict[str, torch.Tensor]:
    """Uninitialised receiving tensors for a descriptor (a broadcast fills them)."""
    return {
        e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device) for e in entries
    }


def stack_rows(name: str, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """One field of several rows as a [len(rows), ...] batch; rows put at different widths
    (two rollout batches of different longest sequences) are right-padded with zeros to the
    widest along every dimension, as the worker's batches are (past `input_lengths` nothing
    counts).

    Raises:
        ValueError: no rows, or rows of different dtypes or numbers of dimensions (naming
            the field).
    """
    if not rows:
        raise ValueError(f"field {name!r}: no rows to stack; a receipt names at least one key")
    dtypes = {str(r.dtype) for r in rows}
    ndims = {r.ndim for r in rows}
    if len(dtypes) > 1 or len(ndims) > 1:
        raise ValueError(
            f"field {name!r}: rows hold dtypes {sorted(dtypes)} and {sorted(ndims)} "
            "dimensions; every row of a field must be put with one dtype and rank"
        )
    shape = tuple(max(int(r.shape[d]) for r in rows) for d in range(rows[0].ndim))
    if all(tuple(r.shape) == shape for r in rows):
        return torch.stack(list(rows))
    out = rows[0].new_zeros((len(rows), *shape))
    for i, row in enumerate(rows):
        out[(i, *(slice(0, n) for n in row.shape))] = row
    return out

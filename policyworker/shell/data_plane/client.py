"""The data-plane client interface: what a presharded call needs from a store of rows by key.

Rows live in named partitions; a row is addressed by its sample key and holds named fields (one
tensor per field, without the batch dimension). Writing a field of existing keys adds the field
(logprob write-back); reading names the fields it wants, never "all of them".
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

import torch

from policyworker.functional.receipts import KVBatchMeta, missing

__all__ = ["DataPlaneClient", "DataPlaneError", "check_rows"]


class DataPlaneError(ValueError):
    """A receipt names rows or fields the data plane does not hold (or a partition is gone)."""


def check_rows(
    partition_id: str,
    keys: Sequence[str],
    held: Mapping[str, Sequence[str]] | None,
    select_fields: Sequence[str],
) -> None:
    """Refuse a read of `select_fields` of `keys` when `held` ({key: fields}, None: no such
    partition) lacks one, naming the partition, the keys and the fields."""
    if held is None:
        raise DataPlaneError(
            f"partition {partition_id!r} is not in the data plane (never registered, or "
            "cleared): put the rows again and send a fresh receipt"
        )
    absent = missing(keys, list(held))
    if absent:
        raise DataPlaneError(
            f"partition {partition_id!r} holds no rows for sample_ids {list(absent)[:8]}"
            f"{' ...' if len(absent) > 8 else ''} ({len(absent)} of {len(keys)}): they were "
            "never put, or were cleared; send a receipt of rows that are there"
        )
    for key in keys:
        lacking = missing(select_fields, held[key])
        if lacking:
            raise DataPlaneError(
                f"sample {key!r} of partition {partition_id!r} has no field(s) {list(lacking)} "
                f"(it holds {sorted(held[key])}): put those fields before this call"
            )


class DataPlaneClient(abc.ABC):
    """One process's handle on the data plane (NeMo-RL's method names and argument order)."""

    @abc.abstractmethod
    def register_partition(
        self, partition_id: str, fields: Sequence[str], num_samples: int
    ) -> None:
        """Declare a partition and the fields its producers may write."""

    @abc.abstractmethod
    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Mapping[str, torch.Tensor],
    ) -> KVBatchMeta:
        """Write `fields` (each [len(sample_ids), ...]) for the rows `sample_ids`; return the
        receipt of those rows and the fields written."""

    @abc.abstractmethod
    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Read `select_fields` of the rows `sample_ids`, stacked in that order; a missing
        partition, key or field raises DataPlaneError before anything is read."""

    @abc.abstractmethod
    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        """Drop the rows `sample_ids` (None: the whole partition)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release this handle (idempotent)."""

    def get_data(self, meta: KVBatchMeta) -> dict[str, torch.Tensor]:
        """Read the rows and fields a receipt names (its `fields` must be set, and it names at
        least one row)."""
        if meta.fields is None:
            raise DataPlaneError(
                f"the receipt of partition {meta.partition_id!r} names no fields: set "
                "`fields` (e.g. meta.with_fields(['input_ids', 'input_lengths']))"
            )
        if meta.size == 0:
            raise DataPlaneError(
                f"the receipt of partition {meta.partition_id!r} names no sample_ids: send "
                "each rank a receipt of at least one row"
            )
        return self.get_samples(meta.sample_ids, meta.partition_id, meta.fields)

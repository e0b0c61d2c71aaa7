"""The in-process data plane: partitions as dictionaries of this process (no Ray, no copies
across processes). Tests and single-process runs use it; every worker that shares it must live
in this process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from policyworker.functional.receipts import KVBatchMeta, stack_rows
from policyworker.shell.data_plane.client import DataPlaneClient, DataPlaneError, check_rows

__all__ = ["InProcessDataPlane", "shared_in_process"]


class InProcessDataPlane(DataPlaneClient):
    """Rows as {partition: {key: {field: tensor}}}; reads return clones, so a caller's edits
    never reach the store."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, dict[str, torch.Tensor]]] = {}

    def register_partition(
        self, partition_id: str, fields: Sequence[str], num_samples: int
    ) -> None:
        self._rows.setdefault(partition_id, {})

    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Mapping[str, torch.Tensor],
    ) -> KVBatchMeta:
        meta = KVBatchMeta(partition_id=partition_id, sample_ids=sample_ids, fields=tuple(fields))
        for name, value in fields.items():
            if value.shape[:1] != (meta.size,):
                raise DataPlaneError(
                    f"field {name!r} has shape {tuple(value.shape)}: its first dimension must "
                    f"be the number of sample_ids ({meta.size})"
                )
        rows = self._rows.setdefault(partition_id, {})
        for i, key in enumerate(meta.sample_ids):
            row = rows.setdefault(key, {})
            for name, value in fields.items():
                row[name] = value[i].detach().to("cpu", copy=True)
        return meta

    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        rows = self._rows.get(partition_id)
        held = None if rows is None else {k: list(v) for k, v in rows.items()}
        check_rows(partition_id, list(sample_ids), held, list(select_fields))
        assert rows is not None
        return {
            name: stack_rows(name, [rows[key][name] for key in sample_ids])
            for name in select_fields
        }

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        if sample_ids is None:
            self._rows.pop(partition_id, None)
            return
        rows = self._rows.get(partition_id, {})
        for key in sample_ids:
            rows.pop(key, None)

    def close(self) -> None:
        self._rows.clear()


_SHARED = InProcessDataPlane()


def shared_in_process() -> InProcessDataPlane:
    """The process's one in-process data plane (what `impl: in_process` attaches to)."""
    return _SHARED

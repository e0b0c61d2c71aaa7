"""The TransferQueue adapter: rows in the `transferqueue` package's storage on a Ray cluster.

The driver (or the rollout side) builds the client with `bootstrap=True`: it starts
TransferQueue's controller and storage actors on the running Ray cluster. Workers attach with
`bootstrap=False` to the controller that is already there. Bulk tensors go from the putting
process to the storage actors and from there to the reading rank, never through the driver.

The package is imported when the adapter is built, after its installed version is checked
against the versions this adapter was written for (its KV calls changed between releases).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker._lazy import installed_version
from policyworker.config.sections import DataPlaneConfig
from policyworker.functional.receipts import KVBatchMeta, missing, stack_rows
from policyworker.shell.data_plane.client import DataPlaneClient, DataPlaneError, check_rows

__all__ = ["SUPPORTED_VERSIONS", "TransferQueueDataPlane", "check_version"]

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.1.11",)
_CONTROLLER = ("TransferQueueController", "transfer_queue")  # TransferQueue's actor name, namespace


def check_version(installed: str | None) -> None:
    """Refuse a TransferQueue version this adapter was not written for, naming it."""
    if installed is None:
        raise DataPlaneError(
            "data_plane.impl='transfer_queue' needs the `transferqueue` package: install "
            f"transferqueue=={SUPPORTED_VERSIONS[-1]} (the `dataplane` extra)"
        )
    if installed not in SUPPORTED_VERSIONS:
        raise DataPlaneError(
            f"transferqueue {installed} is installed; this adapter supports "
            f"{list(SUPPORTED_VERSIONS)}: install transferqueue=={SUPPORTED_VERSIONS[-1]}"
        )


def _dense(name: str, value: Any) -> torch.Tensor:
    # TransferQueue returns a field as a jagged nested tensor (rows put at different widths
    # stay at their widths); the worker reads one rectangular batch, zero-padded.
    if isinstance(value, torch.Tensor) and value.is_nested:
        return stack_rows(name, value.unbind())
    return value


class TransferQueueDataPlane(DataPlaneClient):
    """DataPlaneClient over TransferQueue's key-value calls (`kv_batch_put` / `kv_batch_get` /
    `kv_list` / `kv_clear`)."""

    def __init__(self, config: DataPlaneConfig, *, bootstrap: bool) -> None:
        check_version(installed_version("transferqueue"))
        import ray

        if not ray.is_initialized():
            raise DataPlaneError(
                "data_plane.impl='transfer_queue' runs on a Ray cluster: call ray.init() (or "
                "start the workers as Ray actors) before building the client"
            )
        if config.backend != "simple":
            raise DataPlaneError(
                f"data_plane.backend={config.backend!r} is not wired here: use 'simple' "
                "(TransferQueue's SimpleStorage)"
            )
        import transfer_queue as tq
        from omegaconf import OmegaConf

        self._tq = tq
        self._owner = bootstrap
        if bootstrap:
            storage = {"num_data_storage_units": config.num_storage_units}
            if config.storage_capacity is not None:
                storage["total_storage_size"] = config.storage_capacity
            tq.init(OmegaConf.create({"backend": {"SimpleStorage": storage}}))
            return
        try:
            ray.get_actor(_CONTROLLER[0], namespace=_CONTROLLER[1])
        except ValueError:
            raise DataPlaneError(
                "no TransferQueue controller on this Ray cluster: the driver builds the data "
                "plane first (build_client(config, bootstrap=True)), then workers attach"
            ) from None
        tq.init()

    def register_partition(
        self, partition_id: str, fields: Sequence[str], num_samples: int
    ) -> None:
        # TransferQueue makes a partition on its first put; nothing to declare ahead.
        del partition_id, fields, num_samples

    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Mapping[str, torch.Tensor],
    ) -> KVBatchMeta:
        from tensordict import TensorDict

        meta = KVBatchMeta(partition_id=partition_id, sample_ids=sample_ids, fields=tuple(fields))
        batch = {k: v.detach().to("cpu") for k, v in fields.items()}
        self._tq.kv_batch_put(
            keys=list(meta.sample_ids),
            partition_id=partition_id,
            fields=TensorDict(batch, batch_size=[meta.size]),
        )
        return meta

    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        keys, names = list(sample_ids), list(select_fields)
        try:
            got = self._tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=names)
        except ValueError as exc:  # TransferQueue names neither the keys nor the partition
            self._name_missing_keys(partition_id, keys, names)
            raise DataPlaneError(
                f"partition {partition_id!r}: reading {names} failed: {exc}"
            ) from exc
        present = [k for k in got.keys() if isinstance(k, str)]  # noqa: SIM118 (a TensorDict)
        if got.batch_size[0] != len(keys) or missing(names, present):
            self._name_missing_keys(partition_id, keys, names)
            self._name_missing_fields(partition_id, keys, names)
        return {name: _dense(name, got[name]) for name in names}

    def _name_missing_keys(self, partition_id: str, keys: list[str], names: list[str]) -> None:
        # Only on the error path (one more round trip): which partition or keys are absent.
        listing = self._tq.kv_list(partition_id=partition_id).get(partition_id)
        held = None if listing is None else dict.fromkeys(listing, names)
        check_rows(partition_id, keys, held, names)

    def _name_missing_fields(self, partition_id: str, keys: list[str], names: list[str]) -> None:
        # Only on the error path: read row by row to name the rows that lack a field.
        held = {}
        for key in keys:
            held[key] = [
                n
                for n in names
                if self._tq.kv_batch_get(
                    keys=[key], partition_id=partition_id, select_fields=[n]
                ).batch_size[0]
                == 1
            ]
        check_rows(partition_id, keys, held, names)
        raise DataPlaneError(f"partition {partition_id!r}: reading {names} of {keys} failed")

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        if sample_ids is None:
            listing = self._tq.kv_list(partition_id=partition_id).get(partition_id) or {}
            sample_ids = list(listing)
        if sample_ids:
            self._tq.kv_clear(keys=list(sample_ids), partition_id=partition_id)

    def close(self) -> None:
        # Only the process that started TransferQueue stops it (its close kills the actors).
        if self._owner:
            self._owner = False
            self._tq.close()

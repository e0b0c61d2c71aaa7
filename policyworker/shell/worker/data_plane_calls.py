"""Presharded calls: each rank fetches its own rows from the data plane by a small receipt.

NeMo-RL's `TQWorkerMixin` surface (`setup_data_plane`, `train_presharded`,
`get_logprobs_presharded`, `get_reference_policy_logprobs_presharded`, and the split train step
`begin_train_step_presharded` / `train_microbatch_presharded` / `finish_train_step_presharded` /
`abort_train_step_presharded` over `split_step`). The driver sends each
rank a `KVBatchMeta` (keys, partition, fields) instead of the batch; the rank reads its rows, runs
the plain call on them, and logprob results go back into the data plane as fields
(`prev_logprobs`, `reference_policy_logprobs`) written by one rank per replica group, so no bulk
tensor crosses the driver either way.

Who reads inside a replica group (the tp x cp ranks that hold the same rows) is the
`data_plane.fetch_policy`: every rank (`independent`), or the group's first rank, which then
broadcasts a small descriptor (names, dtypes, shapes) and the tensors one by one on the group
(`leader_broadcast`; `auto` picks it when the group has more than one rank). Tensors are never
pickled. Microbatching and sequence packing are planned by the plain call on the fetched rows,
from this worker's config, as for any batch.

Every refusal (no data plane set up, a receipt naming rows or fields the data plane does not
hold, a cleared partition) happens inside `agreed_checks`, before the plain call: every rank
raises, nothing is trained and nothing is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from cattrs.errors import BaseValidationError

from policyworker.config.converter import converter
from policyworker.config.messages import error_lines
from policyworker.config.sections import DataPlaneConfig
from policyworker.errors import ConfigError
from policyworker.functional.receipts import (
    KVBatchMeta,
    TensorEntry,
    describe_tensors,
    empty_like_entries,
    plan_fetch,
)
from policyworker.shell.data_plane.build import build_client
from policyworker.shell.data_plane.client import DataPlaneClient, DataPlaneError
from policyworker.shell.parallel.agreed_checks import agreed_checks

__all__ = ["DataPlaneCalls", "data_plane_config"]

PREV_LOGPROBS = "prev_logprobs"
REFERENCE_LOGPROBS = "reference_policy_logprobs"


def data_plane_config(cfg: DataPlaneConfig | Mapping[str, Any] | None) -> DataPlaneConfig:
    """A `data_plane:` section as a DataPlaneConfig (a mapping is checked like the rest of the
    config: unknown keys and bad values refused with their paths)."""
    if isinstance(cfg, DataPlaneConfig):
        return cfg
    if cfg is not None:
        try:
            optional_section: Any = DataPlaneConfig | None  # disabled: None, as in the config
            built = converter.structure(dict(cfg), optional_section)
        except BaseValidationError as exc:
            lines = error_lines(exc, "data_plane", DataPlaneConfig)
            raise ConfigError("invalid data_plane config:\n  " + "\n  ".join(lines)) from None
        if built is not None:
            return built
    raise ConfigError(
        "data_plane is not enabled: pass a `data_plane:` section with `enabled: true` to "
        "setup_data_plane (or put one in the policy config)"
    )


class DataPlaneCalls:
    """Mixed into PolicyWorker: the presharded entry points over `train` / `get_logprobs` /
    `get_reference_policy_logprobs` of the class it is mixed into."""

    _dp_client: DataPlaneClient | None = None
    _dp_config: DataPlaneConfig | None = None

    def setup_data_plane(
        self,
        cfg: DataPlaneConfig | Mapping[str, Any] | None = None,
        *,
        client: DataPlaneClient | None = None,
    ) -> None:
        """Attach this rank to the data plane (`cfg` None: the policy config's `data_plane`).

        Called by the driver after the workers are built; a second call keeps the client and
        takes the new section's `fetch_policy`. `client` hands in a client already built
        (tests, a caller's own adapter)."""
        config = data_plane_config(self.cfg.data_plane if cfg is None else cfg)  # type: ignore[attr-defined]
        if self._dp_client is None:
            self._dp_client = (
                client if client is not None else build_client(config, bootstrap=False)
            )
        self._dp_config = config

    def train_presharded(
        self,
        meta: KVBatchMeta,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """`train` on this rank's rows of `meta` (fetched here); returns what `train` returns."""
        data = self._fetch(meta, what="train_presharded")
        return self.train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)  # type: ignore[attr-defined]

    def get_logprobs_presharded(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None
    ) -> None:
        """`get_logprobs` on this rank's rows of `meta`; the [B, S] result is written back as
        the field `prev_logprobs` of those rows (returns None: read it by key)."""
        data = self._fetch(meta, what="get_logprobs_presharded")
        result = self.get_logprobs(data, micro_batch_size)  # type: ignore[attr-defined]
        self._write_back(meta, {PREV_LOGPROBS: result["logprobs"]})

    def get_reference_policy_logprobs_presharded(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None
    ) -> None:
        """`get_reference_policy_logprobs` on this rank's rows of `meta`, written back as the
        field `reference_policy_logprobs` (returns None)."""
        data = self._fetch(meta, what="get_reference_policy_logprobs_presharded")
        result = self.get_reference_policy_logprobs(data, micro_batch_size)  # type: ignore[attr-defined]
        self._write_back(meta, {REFERENCE_LOGPROBS: result["reference_logprobs"]})

    # -- the split train step (NeMo-RL's streaming path) ---------------------------------------

    def begin_train_step_presharded(
        self, loss_fn: Any, gbs: int | None = None, mbs: int | None = None
    ) -> None:
        """Open a split train step (`begin_train_step`); no fetch."""
        self.begin_train_step(loss_fn, gbs=gbs, mbs=mbs)  # type: ignore[attr-defined]

    def train_microbatch_presharded(self, meta: KVBatchMeta) -> None:
        """Forward and backward on this rank's rows of `meta` (fetched here) into the open
        step (`train_microbatch`); nothing is stepped and nothing returned. The receipt is
        checked (open step first, then the rows) before any forward."""
        self._require_open_step("train_microbatch_presharded")  # type: ignore[attr-defined]
        data = self._fetch(meta, what="train_microbatch_presharded")
        self.train_microbatch(data)  # type: ignore[attr-defined]

    def finish_train_step_presharded(self) -> dict[str, Any]:
        """Close the open step (`finish_train_step`); the result says whether this rank leads
        its replica group (`is_replica_leader`), so a driver keeps one result per dp rank."""
        result = self.finish_train_step()  # type: ignore[attr-defined]
        group = self._get_replica_group()  # type: ignore[attr-defined]
        result["is_replica_leader"] = group is None or dist.get_rank(group) == 0
        return result

    def abort_train_step_presharded(self) -> None:
        """Drop the open step without an optimizer step (`abort_train_step`)."""
        self.abort_train_step()  # type: ignore[attr-defined]

    # -- fetch and write-back ------------------------------------------------------------------

    def _require_dp_client(self) -> DataPlaneClient:
        if self._dp_client is None:
            raise DataPlaneError(
                "the data plane is not set up on this worker: call setup_data_plane(cfg) on "
                "every rank before any *_presharded call"
            )
        return self._dp_client

    def _fetch(self, meta: KVBatchMeta, *, what: str) -> dict[str, torch.Tensor]:
        """This rank's rows of `meta`, fetched under the fetch policy; every rank refuses
        together when one cannot get its rows."""
        group = self._get_replica_group()  # type: ignore[attr-defined]
        size = 1 if group is None else dist.get_world_size(group)
        is_leader = group is None or dist.get_rank(group) == 0
        with agreed_checks(self.state.parallel, what=what):  # type: ignore[attr-defined]
            if not isinstance(meta, KVBatchMeta):
                raise DataPlaneError(
                    f"{what} takes a KVBatchMeta receipt, got {type(meta).__name__}: use the "
                    "plain call for a batch of tensors"
                )
            client = self._require_dp_client()
            assert self._dp_config is not None
            plan = plan_fetch(self._dp_config.fetch_policy, group_size=size, is_leader=is_leader)
            rows, error = None, None
            if plan.fetch:
                try:
                    rows = client.get_data(meta)
                except DataPlaneError as exc:
                    if not plan.broadcast:
                        raise
                    error = str(exc)  # the peers raise it too, after the descriptor
            if plan.broadcast:
                rows = _broadcast_rows(rows, error=error, group=group, is_leader=is_leader)
        assert rows is not None
        return rows

    def _write_back(self, meta: KVBatchMeta, fields: Mapping[str, torch.Tensor]) -> None:
        """Write `fields` ([B, ...] over `meta`'s rows) from one rank per replica group."""
        group = self._get_replica_group()  # type: ignore[attr-defined]
        if group is not None and dist.get_rank(group) != 0:
            return
        for name, value in fields.items():
            assert value.shape[0] == meta.size, (name, tuple(value.shape), meta.size)
        cpu = {name: value.detach().to("cpu") for name, value in fields.items()}
        self._require_dp_client().put_samples(meta.sample_ids, meta.partition_id, cpu)


def _broadcast_rows(
    rows: Mapping[str, torch.Tensor] | None,
    *,
    error: str | None,
    group: Any,
    is_leader: bool,
) -> dict[str, torch.Tensor]:
    """The leader's rows on every rank of `group`: first a descriptor (or the leader's error)
    as one small object, then each tensor by a tensor broadcast (no tensor is pickled)."""
    src = dist.get_global_rank(group, 0)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    payload: list[Any] = [None]
    if is_leader:
        payload = [("error", error) if rows is None else ("rows", describe_tensors(rows))]
    dist.broadcast_object_list(payload, src=src, group=group)
    kind, body = payload[0]
    if kind == "error":
        raise DataPlaneError(f"the replica group's leader (rank {src}) could not fetch: {body}")
    entries: tuple[TensorEntry, ...] = body
    if is_leader:
        assert rows is not None
        out = {e.name: rows[e.name].to(device).contiguous() for e in entries}
    else:
        out = empty_like_entries(entries, device=device)
    for entry in entries:
        dist.broadcast(out[entry.name], src=src, group=group)
    return {name: t.to("cpu") for name, t in out.items()} if nccl else out

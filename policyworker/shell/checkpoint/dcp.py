"""Saving Torch Distributed Checkpoint (DCP) state: the optimizer (sharded as trained),
scheduler, RNG and checkpoint id under `optimizer_path/optim/` (staged into reused buffers,
copied, or handed to DCP's writer threads, which copy it out through bounce buffers).
Reading these folders is `dcp_load`.
"""

from __future__ import annotations

import copy
import io
import pathlib
import random
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

import policyworker.shell.checkpoint.bounce as bounce
import policyworker.shell.checkpoint.digests as digests_io
import policyworker.shell.checkpoint.layout as checkpoint_layout_settings
from policyworker.shell.checkpoint.hashing_io import HashingFileSystem
from policyworker.shell.checkpoint.layout import CheckpointError

if TYPE_CHECKING:
    from policyworker.shell.checkpoint.saver import StagingBuffers

__all__ = ["check_saved_metadata", "save_optimizer", "unstored_items"]


# ------------------------------------------------------------------------------ optimizer


def _clone_to(t: Any, *, device: str | None = "cpu", copy: bool = True) -> Any:
    """A detached copy (DTensors stay DTensors with a copied local shard); with ``copy=False``
    a tensor already on `device` is returned as it is (detached)."""
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import DTensor

        local = t.to_local().detach()
        local = local.to(device, copy=copy) if device else local.clone()
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t.detach().to(device, copy=copy) if device else t.detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local().detach() if hasattr(t, "device_mesh") else t.detach()  # pyright: ignore[reportAttributeAccessIssue]


def _as_like(t: Any, staged: torch.Tensor) -> Any:
    """`staged` (a CPU copy of `t`'s local data) in `t`'s form: DTensors stay DTensors."""
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            staged, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return staged


def _sync_save_state(optim_state: Any) -> Any:
    """A sync save's optimizer state: the tensors themselves, detached (DTensors stay DTensors),
    for DCP's writer threads to copy to the CPU as they write (see `_BouncedSavePlanner`).

    Each writer thread copies one tensor, writes it, then copies the next, so one thread's
    device-to-host copy overlaps the other threads' disk writes, rather than every copy running
    before the first write as a copy made here would. DCP holds a file's copies until the file is
    written, so host memory peaks at up to this rank's optimizer bytes for a moment, and nothing
    is kept after the save.

    Those copies run on the writer threads' own streams, so the device work queued on the
    caller's streams (the optimizer step) is waited for here first.
    """
    leaves: list[torch.Tensor] = []
    _tree_map(optim_state, leaves.append)
    for device in {_local(t).device for t in leaves if _local(t).device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    return _tree_map(optim_state, lambda t: t.detach())


class _BouncedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a device tensor is handed to the writer thread
    that asks for it as a CPU copy made through that thread's bounce buffer (`bounce`).

    Without it DCP's writer threads (``thread_count > 1``: torch's `_SerialCpuLoader`) call
    `tensor.cpu()`, and those copies wait for each other (see the `bounce` module docstring).
    CPU tensors (an async save's staged copies) pass through unchanged.
    """

    def __init__(self, pool: bounce.BouncePool) -> None:
        super().__init__()
        self._pool = pool

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and bounce.bounced(data):
            return self._pool.for_this_thread().to_host(data.detach())
        return data


def unstored_items(metadata: Any) -> list[str]:
    """Items a DCP `.metadata` lists without a storage entry (tensor chunks by offset, bytes by
    name): a folder DCP cannot read back whatever its files hold. Empty: complete."""
    stored = {
        (index.fqn, None if index.offset is None else tuple(index.offset))
        for index in (metadata.storage_data or {})
    }
    missing: list[str] = []
    for fqn, item in metadata.state_dict_metadata.items():
        chunks = getattr(item, "chunks", None)
        wanted = [None] if chunks is None else [tuple(c.offsets) for c in chunks]
        missing += [fqn for offset in wanted if (fqn, offset) not in stored]
    return sorted(set(missing))


def check_saved_metadata(folder: pathlib.Path) -> None:
    """Read back the `.metadata` a DCP save just wrote into `folder` and refuse it (before the
    folder is committed) when it names an item with no storage entry."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    missing = unstored_items(FileSystemReader(str(folder)).read_metadata())
    if missing:
        msg = (
            f"the DCP save into {str(folder)!r} wrote a .metadata that lists {missing[:5]} "
            f"({len(missing)} item(s)) without their data; nothing was committed -- save again"
        )
        raise CheckpointError(msg)


def _staged_tree(obj: Any, staging: StagingBuffers) -> Any:
    """`obj` with every tensor replaced by its copy in `staging`'s reused "optimizer" buffers
    (keyed by position in traversal order; copies queued, the caller waits)."""
    leaves: list[torch.Tensor] = []
    _tree_map(obj, leaves.append)
    copies = iter(staging.stage("optimizer", [(i, _local(t)) for i, t in enumerate(leaves)]))
    return _tree_map(obj, lambda t: _as_like(t, next(copies)))


def _tree_map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _tree_map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tree_map(v, fn) for v in obj]
    return copy.deepcopy(obj)


def _to_bytes(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    folder: pathlib.Path,
    *,
    parallel: Any,
    group: Any,
    meta: Mapping[str, Any],
    staging: StagingBuffers | None = None,
    copy_sources: bool = True,
) -> Callable[[], None]:
    """Stage optimizer + scheduler + this rank's RNG as a DCP state dict; returns the writer job.

    With `staging` the optimizer tensors are queued into its reused buffers: call
    `staging.wait()` before the job runs or the optimizer steps. ``copy_sources=False`` (only
    for a job run before the optimizer can step: a sync save) copies nothing here: DCP's writer
    threads copy the state out through their bounce buffers as they write (`_sync_save_state`).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    state: dict[str, Any] = {}
    if optimizer.state:  # get_optimizer_state_dict would run a zero step on an empty optimizer
        optim_state = get_optimizer_state_dict(model, optimizer)
        if staging is not None:
            state["optim"] = _staged_tree(optim_state, staging)
        elif copy_sources:
            state["optim"] = _tree_map(optim_state, _clone_to)
        else:
            state["optim"] = _sync_save_state(optim_state)
    extra = {
        "meta": dict(meta),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "fresh_optimizer": None if optimizer.state else optimizer.state_dict(),
    }
    state["extra"] = _to_bytes(extra)
    state[f"rng_rank{parallel.rank}"] = _to_bytes(_rng_state())
    folder.mkdir(parents=True, exist_ok=True)

    def job() -> None:
        pool = bounce.BouncePool()
        writer = FileSystemWriter(
            str(folder), thread_count=max(1, checkpoint_layout_settings.WRITER_THREADS)
        )
        if digests_io.HASH_WHILE_WRITING:  # each file hashed as it is written
            writer.fs = HashingFileSystem(digests_io.save_algorithm())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore", UserWarning
                )  # "assuming single process" without a group
                save(
                    state,
                    storage_writer=writer,
                    planner=_BouncedSavePlanner(pool),
                    process_group=group,
                    no_dist=group is None,
                )
        finally:
            pool.release()  # DCP's writer threads have ended
        if parallel.rank == 0:  # the coordinator wrote the .metadata
            check_saved_metadata(folder)

    return job

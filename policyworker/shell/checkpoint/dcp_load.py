"""Reading Torch Distributed Checkpoint (DCP) folders: the optimizer state under
`optimizer_path/optim/` (with the checks that name what does not fit: keys, trained parameters,
optimizer kind, folder), DCP-format model weights, and the threaded reader both use.
"""

from __future__ import annotations

import io
import os
import pathlib
import random
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import policyworker.shell.checkpoint.layout as checkpoint_layout_settings
from policyworker.functional.names import canonical_name
from policyworker.shell.checkpoint.dcp import _tree_map, unstored_items
from policyworker.shell.checkpoint.digests import verify_digests
from policyworker.shell.checkpoint.folders import _interrupted_hint
from policyworker.shell.checkpoint.layout import OPTIM_DIR, CheckpointError, _model_state
from policyworker.shell.checkpoint.saver import on_threads

__all__ = ["load_optimizer"]


def _load_dcp_weights(model: nn.Module, folder: pathlib.Path, *, group: Any) -> Callable[[], None]:
    """Read a DCP weights folder (keys = canonical state names) into staging; returns the commit."""
    from torch.distributed.checkpoint.state_dict_loader import load

    live = _model_state(model)
    keys = _dcp_keys(folder)
    staging: dict[str, torch.Tensor] = {}
    for key, t in live.items():
        name = canonical_name(key)
        if name not in keys:
            msg = (
                f"DCP checkpoint {str(folder)!r} has no tensor {name!r};"
                " load a checkpoint of this model"
            )
            raise CheckpointError(msg)
        staging[name] = _empty_like(t.detach())
    load(
        staging,
        storage_reader=_reader(folder),
        process_group=group,
        no_dist=group is None,
    )

    def commit() -> None:
        with torch.no_grad():
            for key, t in live.items():
                t.detach().copy_(staging[canonical_name(key)])

    return commit


def _reader(folder: pathlib.Path) -> Any:
    """A DCP `FileSystemReader` of `folder` that reads its data files from parallel threads.

    torch's reader goes through the files one after another, each item a `torch.load` of a file
    slice plus a copy into the destination, all on one thread: a fraction of the disk's read
    speed (and a save with ``thread_count=WRITER_THREADS`` wrote that many files). Each file's
    items are handed to the stock `read_data` on a thread of its own; both the file reads and
    the tensor copies release the GIL, and DCP's default load planner only assigns dict entries.
    """
    import dataclasses

    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.futures import Future

    class ThreadedReader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                path = self.storage_data[item.storage_index].relative_path
                per_file.setdefault(path, []).append(item)
            read = super().read_data
            on_threads(
                lambda items: read(dataclasses.replace(plan, items=items), planner).wait(),
                list(per_file.values()),
                threads=checkpoint_layout_settings.WRITER_THREADS,
                name="checkpoint-read",
            )
            done: Future[None] = Future()
            done.set_result(None)
            return done

    return ThreadedReader(str(folder))


def _dcp_keys(folder: pathlib.Path) -> set[str]:
    """Flattened keys of a DCP folder, after checking every data file it references is complete."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not (folder / ".metadata").is_file():
        msg = (
            f"DCP checkpoint file {str(folder / '.metadata')!r} does not exist;"
            " the save did not finish -- load another checkpoint"
        )
        raise CheckpointError(msg)
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:
        msg = (
            f"DCP checkpoint file {str(folder / '.metadata')!r} cannot be read ({exc});"
            " it is truncated or corrupt"
        )
        raise CheckpointError(msg) from exc
    missing = unstored_items(metadata)
    if missing:
        msg = (
            f"DCP checkpoint file {str(folder / '.metadata')!r} lists {missing[:5]} "
            f"({len(missing)} item(s)) without their data; it is incomplete -- load another "
            "checkpoint"
        )
        raise CheckpointError(msg)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        path = folder / rel
        have = path.stat().st_size if path.is_file() else -1
        if have < size:
            state = (
                "does not exist" if have < 0 else f"is {have} bytes but the metadata needs {size}"
            )
            msg = (
                f"DCP checkpoint file {str(path)!r} {state};"
                " it is truncated -- load another checkpoint"
            )
            raise CheckpointError(msg)
    return set(metadata.state_dict_metadata)


def _empty_like(t: Any) -> Any:
    """An uninitialised tensor shaped like `t` for DCP to load into (DTensors keep their mesh
    and placements): a load writes every element, so copying the old values first (a clone)
    only costs a pass over the state."""
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import DTensor

        local = torch.empty_like(t.to_local())
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return torch.empty_like(t)


def _from_bytes(value: Any) -> Any:
    raw = value.getvalue() if isinstance(value, io.BytesIO) else value
    return torch.load(io.BytesIO(raw), weights_only=True)


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(_tuples(state["python"])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(obj: Any) -> Any:
    return tuple(_tuples(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    optimizer_path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    parallel: Any = None,
    group: Any = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> Callable[[], None]:
    """Read `optimizer_path/optim` (any layout) into staging; returns the commit.

    The commit loads optimizer and scheduler state and, when this rank's RNG state was saved,
    the torch/python RNG. ``verify=False`` skips the digest check, for a caller that verifies
    the folder itself (`load_checkpoint` checks it concurrently with the reads, and commits only
    after the check passed).

    Raises:
        ValueError: `model` is None (optimizer state is keyed by the model's parameter names).
        CheckpointError: the folder is missing or incomplete.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    if model is None:
        msg = (
            "load_optimizer needs model=<the nn.Module the optimizer trains> to map state to "
            "parameter names"
        )
        raise ValueError(msg)
    folder = _optim_folder(optimizer_path)
    if verify:
        verify_digests(folder)
    keys = _dcp_keys(folder)
    rank = 0 if parallel is None else parallel.rank
    request: dict[str, Any] = {"extra": io.BytesIO()}
    if f"rng_rank{rank}" in keys and restore_rng:
        request[f"rng_rank{rank}"] = io.BytesIO()
    has_optim = any(k.startswith("optim.") for k in keys)
    if has_optim:
        fresh = not optimizer.state
        live = get_optimizer_state_dict(model, optimizer)
        if fresh:  # that initialised the state (a zero-lr step); the worker changes at commit only
            optimizer.state.clear()
        _require_same_parameters(folder, keys, live)
        _require_same_optimizer(folder, keys, live, optimizer)
        request["optim"] = _tree_map(live, _empty_like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming single process" without a group
        try:
            load(
                request,
                storage_reader=_reader(folder),
                process_group=group,
                no_dist=group is None,
            )
        except CheckpointException as exc:  # a BaseException: `except Exception` misses it
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            msg = f"DCP could not read the optimizer checkpoint {str(folder)!r}: {last}"
            raise CheckpointError(msg) from None
    extra = _from_bytes(request["extra"])
    rng = _from_bytes(request[f"rng_rank{rank}"]) if f"rng_rank{rank}" in request else None

    def commit() -> None:
        if has_optim:
            set_optimizer_state_dict(model, optimizer, request["optim"])
        elif extra["fresh_optimizer"] is not None:
            optimizer.state.clear()
            optimizer.load_state_dict(extra["fresh_optimizer"])
        if scheduler is not None and extra["scheduler"] is not None:
            scheduler.load_state_dict(extra["scheduler"])
        if rng is not None:
            _set_rng_state(rng)

    commit.checkpoint_id = extra["meta"].get("checkpoint_id")  # type: ignore[attr-defined]
    return commit


_STATE_PREFIX = "optim.state."


def _require_same_parameters(folder: pathlib.Path, keys: set[str], live: Mapping[str, Any]) -> None:
    """Refuse optimizer state saved for other parameters (e.g. LoRA adapters vs full weights):
    loading it would leave the optimizer stepping state no parameter owns."""
    saved = {k[len(_STATE_PREFIX) :].rsplit(".", 1)[0] for k in keys if k.startswith(_STATE_PREFIX)}
    trained = {name for group in live["param_groups"] for name in group["params"]}
    unknown = sorted(saved - trained)
    if unknown:
        kind = "LoRA adapters" if any(".lora_" in n for n in unknown) else "other parameters"
        msg = (
            f"optimizer checkpoint {str(folder)!r} holds state for {len(unknown)} parameter(s) "
            f"this worker does not train, e.g. {unknown[:3]} ({kind}); it was saved by a worker "
            f"with a different trainable set (LoRA vs full fine-tuning, or other lora_cfg "
            f"targets). Load it into a worker built with the same lora_cfg, or load only the "
            f"weights (optimizer_path=None)"
        )
        raise CheckpointError(msg)


_GROUP_PREFIX = "optim.param_groups."


def _require_same_optimizer(
    folder: pathlib.Path, keys: set[str], live: Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> None:
    """Refuse optimizer state of another optimizer class (AdamW state into SGD): DCP would fail
    on the first setting the checkpoint lacks, with its whole traceback."""
    saved_settings = {
        k[len(_GROUP_PREFIX) :].split(".", 1)[1]
        for k in keys
        if k.startswith(_GROUP_PREFIX) and "." in k[len(_GROUP_PREFIX) :]
    }
    live_settings = {k for group in live["param_groups"] for k in group}
    saved_state = {k.rsplit(".", 1)[1] for k in keys if k.startswith(_STATE_PREFIX)}
    live_state = {k for per_param in live["state"].values() for k in per_param}
    lacks = sorted(live_settings - saved_settings)
    if not lacks and (not live_state or saved_state <= live_state):
        return
    name = type(optimizer).__name__
    msg = (
        f"optimizer checkpoint {str(folder)!r} was saved by another optimizer than this "
        f"worker's {name}: it lacks {name}'s settings {lacks} and holds settings "
        f"{sorted(saved_settings - live_settings)} and state {sorted(saved_state - live_state)}; "
        f"build the worker with the optimizer it was saved with (policy.optimizer.name), or "
        f"load only the weights (optimizer_path=None)"
    )
    raise CheckpointError(msg)


def _optim_folder(optimizer_path: str | os.PathLike[str]) -> pathlib.Path:
    path = pathlib.Path(optimizer_path)
    # A save under P writes P/optim, also when P is itself named 'optim' (save(.., 'run/optim')):
    # the nested folder wins unless P is the DCP folder itself.
    if (path / OPTIM_DIR).is_dir() and not (path / ".metadata").is_file():
        return path / OPTIM_DIR
    if path.name == OPTIM_DIR or (path / ".metadata").is_file():
        return path
    msg = (
        f"no optimizer checkpoint at {str(path)!r}: expected '{OPTIM_DIR}/.metadata' under it"
        + _interrupted_hint(path / OPTIM_DIR)
    )
    raise CheckpointError(msg)

"""HF safetensors weights: staged per rank, `pwrite`n at planned offsets, validated, loaded.

Every rank writes the bytes of the boxes its local shard owns at offsets that every rank
computes identically (`layout.plan_safetensors_files`); a load validates headers and names
before it changes any parameter and returns a commit function that copies the staged values.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
from torch import nn

from policyworker.shell.checkpoint.commit import _write_json, read_json
from policyworker.shell.checkpoint.layout import (
    INDEX_FILE,
    MANIFEST_FILE,
    MAX_FILE_BYTES,
    MODEL_DIR,
    _ST_DTYPES,
    CheckpointError,
    FilePlan,
    HFTensor,
    _contiguous_runs,
    _intersect,
    _itemsize,
    _Local,
    _locals,
    _model_state,
    _specs,
    hf_layout,
    plan_safetensors_files,
    saved_keys,
)
from policyworker.shell.refit.hf_names import checkpoint_layout
from policyworker.shell.refit.params import tie_word_embeddings

__all__ = [
    "detect_weights_format",
    "load_hf_weights",
    "model_hf_layout",
    "save_hf_weights",
    "validate_hf_folder",
]


def model_hf_layout(
    model: nn.Module, specs: Mapping[str, tuple[Sequence[int], torch.dtype]]
) -> list[HFTensor]:
    """`hf_layout` of `model`'s state `specs`: the names and layout `save_pretrained` writes
    (transformers' own conversion, the same as the refit stream's)."""
    tied = tie_word_embeddings(model)
    saved = saved_keys(specs, tie_word_embeddings=tied)
    pieces = checkpoint_layout(model, {n: specs[k][0] for k, n in saved.items()})
    return hf_layout(specs, tie_word_embeddings=tied, pieces=pieces)


@attrs.define
class _Piece:
    """A staged CPU block of one HF tensor, with where its runs go in the file."""

    file: str
    tensor: torch.Tensor  # contiguous CPU copy of the intersection
    runs: list[tuple[int, tuple[int, ...], int]]  # (byte offset in file, leading idx, elements)


def _stage_hf(
    locals_: Mapping[str, _Local], layout: Sequence[HFTensor], plans: Sequence[FilePlan]
) -> list[_Piece]:
    """CPU copies of the parts of each HF tensor this rank owns, with their file offsets."""
    where = {name: (p.file, off) for p in plans for name, off in p.offsets.items()}
    pieces = []
    for t in layout:
        local = locals_[t.key]
        if not local.owner:
            continue
        sub = _intersect(t.box, local.box)
        if sub is None:
            continue
        view = local.tensor[
            tuple(slice(a - lb, b - lb) for (a, b), (lb, _) in zip(sub, local.box, strict=True))
        ]
        cpu = view.to("cpu", copy=True).contiguous()
        file, base = where[t.name]
        size = _itemsize(t.dtype)
        runs = [(base + off * size, idx, n) for off, idx, n in _contiguous_runs(sub, t.box)]
        pieces.append(_Piece(file, cpu, runs))
    return pieces


def _write_hf_files(
    folder: pathlib.Path,
    plans: Sequence[FilePlan],
    pieces: Sequence[_Piece],
    *,
    write_headers: bool,
) -> None:
    """pwrite this rank's staged pieces (and, on one rank, the headers) into the planned files."""
    fds: dict[str, int] = {}
    try:
        for plan in plans:
            fd = os.open(folder / plan.file, os.O_WRONLY | os.O_CREAT, 0o644)
            fds[plan.file] = fd
            if write_headers:
                os.ftruncate(fd, plan.size)
                os.pwrite(fd, plan.header, 0)
        for piece in pieces:
            flat_rows = piece.tensor
            for offset, idx, n in piece.runs:
                block = flat_rows[idx] if idx else flat_rows
                data = block.reshape(-1)[:n].view(torch.uint8).numpy()
                _pwrite_all(fds[piece.file], memoryview(data), offset)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


# ------------------------------------------------------------------------------ validation


def _read_header(path: pathlib.Path) -> dict[str, Any]:
    """The safetensors header of `path`; CheckpointError when missing or truncated."""
    if not path.is_file():
        msg = (
            f"checkpoint file {str(path)!r} does not exist;"
            " the save that wrote it did not finish -- load another checkpoint"
        )
        raise CheckpointError(msg)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        raw = f.read(n) if 0 <= n <= size - 8 else b""
    try:
        header = json.loads(raw) if raw else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        msg = (
            f"checkpoint file {str(path)!r} ({size} bytes) has no readable safetensors "
            "header; it is truncated or not a safetensors file"
        )
        raise CheckpointError(msg)
    _check_entries(path, header)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        msg = (
            f"checkpoint file {str(path)!r} is {size} bytes but its header needs {8 + n + end}; "
            f"it is truncated (an interrupted save or copy) -- load another checkpoint"
        )
        raise CheckpointError(msg)
    return header


_ITEMSIZE_OF = {code: _itemsize(dtype) for dtype, code in _ST_DTYPES.items()}


def _check_entries(path: pathlib.Path, header: Mapping[str, Any]) -> None:
    """Each tensor's dtype is known and its byte range holds exactly shape x itemsize bytes
    (an edited dtype or shape would otherwise reinterpret the bytes silently)."""
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in entry["data_offsets"])
            numel = math.prod(int(d) for d in entry["shape"])
            itemsize = _ITEMSIZE_OF[entry["dtype"]]
        except (KeyError, TypeError, ValueError) as exc:
            msg = (f"checkpoint file {str(path)!r}: tensor {name!r} has an unreadable header "
                   f"entry {entry!r} ({exc!r}); the file was edited -- load another checkpoint")
            raise CheckpointError(msg) from exc
        if stop - start != numel * itemsize:
            msg = (f"checkpoint file {str(path)!r}: tensor {name!r} is {entry['dtype']} "
                   f"{entry['shape']} ({numel * itemsize} bytes) but its data holds "
                   f"{stop - start} bytes; the header was edited -- load another checkpoint")
            raise CheckpointError(msg)


def validate_hf_folder(
    folder: str | os.PathLike[str],
) -> dict[str, tuple[pathlib.Path, dict[str, Any]]]:
    """`{name: (file, header entry)}` of an HF safetensors folder, every file checked complete.

    Raises:
        CheckpointError: the index names a missing file, a file is truncated, or a tensor listed
            in the index is not in its file.
    """
    folder = pathlib.Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            msg = f"checkpoint file {str(index)!r} has no 'weight_map' object; it was edited"
            raise CheckpointError(msg)
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = None
    if not files:
        msg = (
            f"{str(folder)!r} holds no *.safetensors files and no {INDEX_FILE};"
            " pass an HF model folder"
        )
        raise CheckpointError(msg)
    out: dict[str, tuple[pathlib.Path, dict[str, Any]]] = {}
    for file in files:
        header = _read_header(folder / file)
        out.update({k: (folder / file, v) for k, v in header.items() if k != "__metadata__"})
    for name, file in (weight_map or {}).items():
        if name not in out or out[name][0].name != file:
            msg = (
                f"{str(folder / file)!r} lacks tensor {name!r} that {INDEX_FILE} places "
                "there; the folder is inconsistent"
            )
            raise CheckpointError(msg)
    return out


def detect_weights_format(
    weights_path: str | os.PathLike[str],
) -> Literal["safetensors", "dcp", "peft"]:
    """Format of a weights folder (`weights_path/model` or `weights_path` itself).

    Raises:
        CheckpointError: the folder does not exist or holds no known format.
    """
    folder = _model_folder(weights_path)
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if "adapter_config.json" in names:
        return "peft"
    if any(n.endswith(".distcp") for n in names) or ".metadata" in names:
        return "dcp"
    if INDEX_FILE in names or any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    msg = (
        f"no checkpoint at {str(weights_path)!r}: neither it nor its '{MODEL_DIR}' subfolder "
        f"holds safetensors, DCP (.distcp) or a PEFT adapter" + _interrupted_hint(folder)
        + _unfinalized_hint(pathlib.Path(weights_path))
    )
    raise CheckpointError(msg)


def _unfinalized_hint(weights_path: pathlib.Path) -> str:
    """A save that is still staged (async, not finalized) leaves `model.tmp-<id>` folders."""
    staged = sorted(p.name for p in weights_path.glob(f"{MODEL_DIR}.tmp-*")) if (
        weights_path.is_dir()) else []
    return (f"; a save into it was never finalized ({staged[0]}): save_checkpoint is "
            f"asynchronous unless is_final_checkpoint=True, so call "
            f"worker.finalize_async_save() before loading" if staged else "")


def _interrupted_hint(folder: pathlib.Path) -> str:
    if not folder.parent.is_dir():
        return ""
    left = sorted(
        p.name for p in folder.parent.iterdir() if p.name.startswith(f"{folder.name}.old-")
    )
    return (
        f"; an interrupted replacement left {left}: rename it back to {folder.name!r}"
        if left
        else ""
    )


def _model_folder(weights_path: str | os.PathLike[str]) -> pathlib.Path:
    path = pathlib.Path(weights_path)
    # A save under P writes P/model, also when P is itself named 'model' (save('run/model')).
    return path / MODEL_DIR if (path / MODEL_DIR).is_dir() else path


# ------------------------------------------------------------------------------ weights


def _hf_class_name(model: nn.Module) -> str:
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__


def save_hf_weights(
    model: nn.Module,
    folder: pathlib.Path,
    *,
    parallel: Any,
    state: Mapping[str, torch.Tensor] | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    write_config: bool = True,
    manifest: Mapping[str, Any] | None = None,
) -> Callable[[], None]:
    """Stage this rank's share of an HF safetensors folder; returns the job that writes it.

    `state` (default: the live model state) supplies the values; shapes and placements come from
    the live model. Rank 0 writes config/index/manifest now; every rank's job `pwrite`s its bytes.
    """
    live = _model_state(model)
    values = live if state is None else {k: state[k] for k in live if k in state}
    layout = model_hf_layout(model, _specs({k: live[k] for k in values}))
    plans = plan_safetensors_files(layout, max_file_bytes=max_file_bytes)
    locals_ = _locals(live, rank=parallel.rank, world_size=parallel.world_size)
    if state is not None:
        locals_ = {
            k: attrs.evolve(locals_[k], tensor=_as_local(values[k], locals_[k])) for k in values
        }
    pieces = _stage_hf(locals_, layout, plans)
    folder.mkdir(parents=True, exist_ok=True)
    if parallel.rank == 0:
        weight_map = {name: p.file for p in plans for name in p.offsets}
        total = sum(t.nbytes for t in layout)
        _write_json(
            folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
        if write_config and getattr(model, "config", None) is not None:
            config = copy.deepcopy(model.config)
            config.architectures = [_hf_class_name(model)]
            config.save_pretrained(folder)
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                gen.save_pretrained(folder)
        if manifest is not None:
            _write_json(folder / MANIFEST_FILE, dict(manifest))
    write_headers = parallel.rank == 0
    return lambda: _write_hf_files(folder, plans, pieces, write_headers=write_headers)


def _as_local(value: torch.Tensor, like: _Local) -> torch.Tensor:
    """A reference/state value as this rank's local block of the live tensor `like`."""
    value = value.detach()
    if hasattr(value, "device_mesh"):
        return value.full_tensor() if like.gathered else value.to_local()
    if like.gathered and tuple(value.shape) != tuple(like.tensor.shape):  # a local shard
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            value.to(like.tensor.device),
            like.mesh,
            like.placements,
            run_check=False,
            shape=like.tensor.shape,
        ).full_tensor()
    return value


def _check_names(
    model_layout: Sequence[HFTensor],
    found: Mapping[str, tuple[pathlib.Path, dict[str, Any]]],
    folder: pathlib.Path,
) -> None:
    missing = [t.name for t in model_layout if t.name not in found]
    wrong = [
        f"{t.name}: file {found[t.name][1]['shape']} vs model {list(t.shape)}"
        for t in model_layout
        if t.name in found and list(found[t.name][1]["shape"]) != list(t.shape)
    ]
    if missing or wrong:
        msg = (
            f"checkpoint {str(folder)!r} does not fit the model: missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, shape mismatches {wrong[:8]}; load a "
            f"checkpoint saved from this model architecture and size"
        )
        raise CheckpointError(msg)


def load_hf_weights(
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    parallel: Any,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Callable[[], None]:
    """Read an HF safetensors folder into staging for this rank's shards; returns the commit.

    Everything is validated and read before the returned callable copies into `state` (default:
    the live model), so a failed load leaves the model unchanged. Works for any layout: each
    rank reads only the slices its shards cover.
    """
    from safetensors import safe_open

    folder = pathlib.Path(folder)
    found = validate_hf_folder(folder)
    live = _model_state(model)
    layout = model_hf_layout(model, _specs(live))
    _check_names(layout, found, folder)
    locals_ = _locals(live, rank=parallel.rank, world_size=parallel.world_size)
    in_layout = {t.key for t in layout}
    staging = {
        k: torch.empty(tuple(b - a for a, b in loc.box), dtype=loc.tensor.dtype)
        for k, loc in locals_.items()
        if k in in_layout
    }
    handles: dict[pathlib.Path, Any] = {}
    try:
        for t in layout:
            loc, file = locals_[t.key], found[t.name][0]
            sub = _intersect(t.box, loc.box)
            if sub is None:
                continue
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            squeeze = len(t.box) - len(t.shape)
            src = tuple(
                slice(a - b0, b - b0)
                for (a, b), (b0, _) in zip(sub[squeeze:], t.box[squeeze:], strict=True)
            )
            block = (
                handles[file].get_slice(t.name)[src] if src else handles[file].get_tensor(t.name)
            )
            dst = tuple(slice(a - lb, b - lb) for (a, b), (lb, _) in zip(sub, loc.box, strict=True))
            staging[t.key][dst] = block.reshape(staging[t.key][dst].shape)
    finally:
        handles.clear()
    target = live if state is None else state

    # Keys outside the layout (a tied lm_head) alias a loaded tensor: fill them from it.
    aliases = {
        k: next(o for o in staging if live[o] is live[k])
        for k in target
        if k in live and k not in staging and any(live[o] is live[k] for o in staging)
    }

    def commit() -> None:
        with torch.no_grad():
            for key, value in staging.items():
                _copy_into(target[key], value, locals_[key])
            for key, source in aliases.items():
                if target[key] is not target[source]:
                    _copy_into(target[key], staging[source], locals_[source])

    return commit


def _copy_into(dest: torch.Tensor, value: torch.Tensor, local: _Local) -> None:
    dest = dest.detach()
    if hasattr(dest, "device_mesh"):
        if local.gathered:  # full value on every rank: keep this rank's part of the placement
            from torch.distributed.tensor import DTensor, Replicate

            full = DTensor.from_local(
                value.to(dest.device),
                dest.device_mesh,
                [Replicate()] * dest.device_mesh.ndim,
                run_check=False,
            )
            value = full.redistribute(dest.device_mesh, dest.placements).to_local()
        dest = dest.to_local()
    dest.copy_(value)

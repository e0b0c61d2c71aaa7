"""What a checkpoint folder holds: safetensors headers checked complete, the weights format.

Read-only: these functions look at files and raise `CheckpointError` naming the file and the
fix; they never change a folder or a model.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Mapping
from typing import Any, Literal

from policyworker.functional.safetensors_layout import _ST_DTYPES, itemsize
from policyworker.shell.checkpoint.commit import read_json
from policyworker.shell.checkpoint.layout import INDEX_FILE, MODEL_DIR, CheckpointError

__all__ = ["detect_weights_format", "validate_hf_folder"]


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


_ITEMSIZE_OF = {code: itemsize(dtype) for dtype, code in _ST_DTYPES.items()}


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
            msg = (
                f"checkpoint file {str(path)!r}: tensor {name!r} has an unreadable header "
                f"entry {entry!r} ({exc!r}); the file was edited -- load another checkpoint"
            )
            raise CheckpointError(msg) from exc
        if stop - start != numel * itemsize:
            msg = (
                f"checkpoint file {str(path)!r}: tensor {name!r} is {entry['dtype']} "
                f"{entry['shape']} ({numel * itemsize} bytes) but its data holds "
                f"{stop - start} bytes; the header was edited -- load another checkpoint"
            )
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
        f"holds safetensors, DCP (.distcp) or a PEFT adapter"
        + _interrupted_hint(folder)
        + _unfinalized_hint(pathlib.Path(weights_path))
    )
    raise CheckpointError(msg)


def _unfinalized_hint(weights_path: pathlib.Path) -> str:
    """A save that is still staged (async, not finalized) leaves `model.tmp-<id>` folders."""
    staged = (
        sorted(p.name for p in weights_path.glob(f"{MODEL_DIR}.tmp-*"))
        if (weights_path.is_dir())
        else []
    )
    return (
        f"; a save into it was never finalized ({staged[0]}): save_checkpoint is "
        f"asynchronous unless is_final_checkpoint=True, so call "
        f"worker.finalize_async_save() before loading"
        if staged
        else ""
    )


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

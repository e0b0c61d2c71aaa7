"""Checkpoints: HF safetensors weights written shard by shard, DCP optimizer state, atomic renames.

Layout (API.md §7, details in docs/checkpoints.md)::

    weights_path/model/       HF folder: config.json, generation_config.json,
                              model.safetensors.index.json, model-0000i-of-0000n.safetensors
                              (fp32 master weights), policyworker_checkpoint.json
                              -- or, for LoRA runs, a PEFT adapter folder
    weights_path/reference/   the ORIGINAL reference weights (same HF format; hard-linked
                              from the previous save while they are unchanged)
    optimizer_path/optim/     DCP: optimizer (sharded as trained), scheduler, RNG, checkpoint id
    tokenizer_path/           tokenizer.save_pretrained (rank 0)

Weights never meet on one rank: every HF tensor is a box (a region) of one model tensor; each
rank owns the part of that box its local shard covers (replicas: the one at coordinate 0) and
`pwrite`s those bytes at offsets that every rank computes identically from the global shapes
(the safetensors header is a pure function of names, shapes and dtypes). Only placements other
than Shard/Replicate (e.g. the `_StridedShard` of 2-D TP+FSDP) fall back to a per-tensor gather.

Saves are asynchronous: the call returns after staging (a CPU copy of this rank's pieces); a
background thread writes; `finalize_async_save` waits, agrees over all ranks that every write
landed, and rank 0 commits: it fsyncs every `<final>.tmp-<token>` folder, writes a commit record
naming all of them, renames each into place and removes the record. A crash after the record is
rolled forward by the next load or save (`recover_checkpoint_commits`), so weights and optimizer
always come from one save.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import fcntl
import io
import itertools
import json
import math
import os
import pathlib
import random
import secrets
import shutil
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from torch import nn

from policyworker.functional.names import canonical_name, is_lora_param, to_hf_tensors
from policyworker.shell.parallel import reshard
from policyworker.shell.params import tie_word_embeddings

__all__ = [
    "COMMIT_RECORD_PREFIX",
    "FINALIZE_TIMEOUT_S",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "MAX_FILE_BYTES",
    "MODEL_DIR",
    "OPTIM_DIR",
    "REFERENCE_DIR",
    "AsyncSaver",
    "CheckpointError",
    "HFTensor",
    "detect_weights_format",
    "finalize_async_save",
    "hf_layout",
    "load_checkpoint",
    "load_checkpoint_at_init",
    "load_hf_weights",
    "load_optimizer",
    "plan_safetensors_files",
    "recover_checkpoint_commits",
    "save_checkpoint",
    "save_hf_weights",
    "save_optimizer",
    "validate_hf_folder",
]

MODEL_DIR = "model"
OPTIM_DIR = "optim"
REFERENCE_DIR = "reference"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "policyworker_checkpoint.json"
MAX_FILE_BYTES = 5 * 2**30  # HF's default shard size
FINALIZE_TIMEOUT_S = 3600.0
LOCK_TIMEOUT_S = 600.0
COMMIT_RECORD_PREFIX = "policyworker_commit-"
FORMAT_VERSION = 1
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim of a model tensor


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not fit the model."""


# ------------------------------------------------------------------------------ pure layout


@attrs.frozen
class HFTensor:
    """One tensor of the HF checkpoint: the `box` region of model tensor `key`, named `name`."""

    name: str
    key: str
    box: Box
    shape: tuple[int, ...]  # the HF shape: the box's sizes, minus a squeezed leading dim
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _box_of_view(view: torch.Tensor, base_shape: Sequence[int]) -> Box:
    """The region of a contiguous `base_shape` tensor that `view` (a slice of it) covers."""
    strides = [math.prod(base_shape[d + 1 :]) for d in range(len(base_shape))]
    rest, start = view.storage_offset(), []
    for s in strides:
        start.append(rest // s if s else 0)
        rest = rest % s if s else rest
    sizes = [1] * (len(base_shape) - view.dim()) + list(view.shape)
    return tuple((a, a + n) for a, n in zip(start, sizes, strict=True))


def hf_layout(
    specs: Mapping[str, tuple[Sequence[int], torch.dtype]], *, tie_word_embeddings: bool
) -> list[HFTensor]:
    """The HF checkpoint tensors of a model state `{key: (shape, dtype)}`, in state order.

    Wrapper prefixes are stripped, LoRA adapter tensors skipped, a tied `lm_head.weight`
    dropped, and transformers-5 fused experts split into per-expert boxes (what
    `save_pretrained` writes).
    """
    out: list[HFTensor] = []
    for key, (shape, dtype) in specs.items():
        name = canonical_name(key)
        if is_lora_param(key) or (tie_word_embeddings and name == "lm_head.weight"):
            continue
        base = torch.empty(tuple(shape), dtype=dtype, device="meta")
        for hf_name, view in to_hf_tensors(name, base):
            out.append(
                HFTensor(hf_name, key, _box_of_view(view, tuple(shape)), tuple(view.shape), dtype)
            )
    return out


@attrs.frozen
class FilePlan:
    """One safetensors file: its name, header bytes and each tensor's absolute data offset."""

    file: str
    header: bytes
    offsets: dict[str, int]
    size: int


def plan_safetensors_files(
    tensors: Sequence[HFTensor], *, max_file_bytes: int = MAX_FILE_BYTES
) -> list[FilePlan]:
    """Split `tensors` (in order) into `model-0000i-of-0000n.safetensors` files and lay them out.

    A file closes before the tensor that would take it past `max_file_bytes` (a larger tensor
    gets a file of its own). Every rank computes the same plan from the same specs.
    """
    groups: list[list[HFTensor]] = [[]]
    used = 0
    for t in tensors:
        if groups[-1] and used + t.nbytes > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append(t)
        used += t.nbytes
    plans = []
    for i, group in enumerate(groups, start=1):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        begin = 0
        for t in group:
            header[t.name] = {
                "dtype": _ST_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [begin, begin + t.nbytes],
            }
            begin += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        head = struct.pack("<Q", len(raw)) + raw
        offsets = {t.name: len(head) + header[t.name]["data_offsets"][0] for t in group}
        plans.append(
            FilePlan(
                f"model-{i:05d}-of-{len(groups):05d}.safetensors", head, offsets, len(head) + begin
            )
        )
    return plans


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in box) else box


def _contiguous_runs(sub: Box, full: Box) -> Iterator[tuple[int, tuple[int, ...], int]]:
    """Row-major runs of region `sub` inside region `full`: (element offset, leading index, length).

    The leading index selects the run inside the `sub` block (dims before the first partial dim).
    """
    shape = [hi - lo for lo, hi in full]
    sub_shape = [hi - lo for lo, hi in sub]
    start = [s - f for (s, _), (f, _) in zip(sub, full, strict=True)]
    k = len(shape)
    while k > 0 and sub_shape[k - 1] == shape[k - 1]:
        k -= 1
    k = max(k - 1, 0)  # dims >= k+1 are full: a run covers dims k.. of the sub block
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = math.prod(sub_shape[k:])
    for idx in itertools.product(*(range(n) for n in sub_shape[:k])):
        offset = sum((start[d] + i) * strides[d] for d, i in enumerate(idx))
        yield offset + (start[k] * strides[k] if shape else 0), idx, length


# ------------------------------------------------------------------------------ local pieces


@attrs.frozen
class _Local:
    """This rank's view of one model tensor: the local tensor and the box it covers."""

    tensor: torch.Tensor
    box: Box
    owner: bool  # writes the bytes of this box (one rank per replica set)
    placements: Any = None  # DTensor placements (None for plain tensors)
    mesh: Any = None
    gathered: bool = False


def _full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def _dtensor_box(t: Any) -> tuple[Box, bool] | None:
    """Box of a DTensor's local shard and whether this rank owns it; None for other placements."""
    from torch.distributed.tensor import Replicate, Shard

    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    mesh = t.device_mesh
    owner, shards, strided = True, [], []
    for axis, placement in enumerate(t.placements):
        if type(placement) is Replicate:
            owner = owner and coord[axis] == 0
        elif type(placement) is Shard:
            shards.append((axis, placement.dim))
        elif type(placement).__name__ == "_StridedShard":  # FSDP2 over TP: split after later axes
            strided.append((axis, placement.dim))
            later = math.prod(
                mesh.size(a)
                for a, p in enumerate(t.placements)
                if a > axis and type(p) is Shard and p.dim == placement.dim
            )
            if placement.split_factor != later:
                return None
        else:
            return None
    box = [list(b) for b in _full_box(t.shape)]
    for axis, dim in shards + strided:
        lo, hi = box[dim]
        chunk = -(-(hi - lo) // mesh.size(axis))
        s = min(lo + coord[axis] * chunk, hi)
        box[dim] = [s, min(s + chunk, hi)]
    result = tuple((a, b) for a, b in box)
    if tuple(b - a for a, b in result) != tuple(t.to_local().shape):
        return None
    return result, owner


def _locals(state: Mapping[str, torch.Tensor], *, rank: int, world_size: int) -> dict[str, _Local]:
    """Local pieces of every state tensor, in state order (collective for gathered fallbacks)."""
    out: dict[str, _Local] = {}
    for i, (key, t) in enumerate(state.items()):
        t = t.detach()
        if hasattr(t, "device_mesh"):
            found = _dtensor_box(t)
            if found is None:  # unusual placement: gather this one tensor
                out[key] = _Local(
                    t.full_tensor(),
                    _full_box(t.shape),
                    rank == 0,
                    t.placements,
                    t.device_mesh,
                    gathered=True,
                )
            else:
                out[key] = _Local(t.to_local(), found[0], found[1], t.placements, t.device_mesh)
        else:
            out[key] = _Local(t, _full_box(t.shape), i % world_size == rank)
    return out


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Live params + persistent buffers (sharded form: FSDP2 roots are resharded first)."""
    reshard(model)
    return model.state_dict(keep_vars=True)


def _specs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


# ------------------------------------------------------------------------------ file effects


def _fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: pathlib.Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            _fsync_path(pathlib.Path(dirpath) / f)
        _fsync_path(pathlib.Path(dirpath))


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


# ------------------------------------------------------------------------------ commit protocol
#
# A save is committed by a record, not by its renames. Once every temporary folder of the save
# is written and fsynced, rank 0 writes `policyworker_commit-<id>.json` (atomically: a `.part`
# file, fsync, rename) into every folder that holds one of the save's final folders. The record
# names each `<final>.tmp-<id>` -> `<final>` pair and the inode of each temporary folder. From
# then on the save counts as done: rank 0 renames the folders into place, fsyncs their parents,
# deletes the `.old-<id>` copies and then the records. Whoever finds a record later (the next
# save, any load) finishes those steps; every step checks the current state first, so a crash
# during recovery is recovered the same way. A temporary folder without a record was never
# committed (it may be incomplete) and is never renamed into place.


def _record_name(token: str) -> str:
    return f"{COMMIT_RECORD_PREFIX}{token}.json"


def _old_for(final: pathlib.Path, token: str) -> pathlib.Path:
    return final.with_name(f"{final.name}.old-{token}")


def _inode(path: pathlib.Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _locked(dirs: Sequence[pathlib.Path], *, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive `flock` on each existing folder of `dirs` (taken in sorted order).

    It keeps a commit and recoveries from other processes (a load while a save commits) from
    renaming the same folders at once. The kernel drops the lock when its holder dies. Where
    the filesystem has no flock, the folders are used unlocked.
    """
    fds: list[int] = []
    try:
        for d in sorted({os.path.abspath(d) for d in dirs}):
            if not os.path.isdir(d):
                continue
            fd = os.open(d, os.O_RDONLY)
            fds.append(fd)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        msg = (
                            f"checkpoint folder {d!r} stayed locked by another process for "
                            f"{timeout_s} s (a save committing into it); wait for that process "
                            f"or end it, then retry"
                        )
                        raise TimeoutError(msg) from None
                    time.sleep(0.01)
                except OSError:  # no flock on this filesystem
                    break
        yield
    finally:
        for fd in fds:
            os.close(fd)  # closing the descriptor releases its lock


def _write_commit_records(
    token: str, pairs: Sequence[tuple[pathlib.Path, pathlib.Path]]
) -> list[pathlib.Path]:
    """Write the commit record of save `token` beside every final folder; returns their paths.

    Call only after every temporary folder of `pairs` is complete and fsynced.
    """
    records = [d / _record_name(token) for d in sorted({final.parent for _, final in pairs})]
    for record in records:
        base = record.parent
        body = {
            "checkpoint_id": token,
            "format_version": FORMAT_VERSION,
            "pairs": [
                {
                    "tmp": os.path.relpath(tmp, base),
                    "final": os.path.relpath(final, base),
                    "inode": os.stat(tmp).st_ino,
                }
                for tmp, final in pairs
            ],
            "records": [os.path.relpath(r, base) for r in records],
        }
        part = record.with_name(record.name + ".part")
        part.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        _fsync_path(part)
        os.rename(part, record)
        _fsync_path(base)
    return records


def _read_record(record: pathlib.Path) -> dict[str, Any]:
    try:
        body = json.loads(record.read_text())
        base = record.parent
        return {
            "checkpoint_id": str(body["checkpoint_id"]),
            "pairs": [
                (
                    pathlib.Path(os.path.normpath(base / p["tmp"])),
                    pathlib.Path(os.path.normpath(base / p["final"])),
                    int(p["inode"]),
                )
                for p in body["pairs"]
            ],
            "records": [pathlib.Path(os.path.normpath(base / r)) for r in body["records"]],
        }
    except (ValueError, KeyError, TypeError) as exc:
        msg = (
            f"checkpoint commit record {str(record)!r} is unreadable ({exc}); it is written "
            f"atomically, so it was edited or copied in part -- restore it or delete it (then "
            f"the save it names is lost)"
        )
        raise CheckpointError(msg) from exc


def _put_in_place(tmp: pathlib.Path, final: pathlib.Path, inode: int, token: str) -> None:
    """Make the folder with `inode` (written as `tmp`) `final`; a replaced one goes to `.old-`.

    Idempotent: the state on disk says which step comes next.
    """
    old = _old_for(final, token)
    if _inode(final) == inode:  # already in place; after an exchange `tmp` is the old folder
        if tmp.exists():
            if old.exists():
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, old)
        return
    if _inode(tmp) != inode:
        msg = (
            f"checkpoint save {token} was committed but its folder {str(tmp)!r} is gone and "
            f"{str(final)!r} is not it (the folder was moved, copied or deleted by hand); "
            f"put the save's folder back as {tmp.name!r}, or delete "
            f"'{final.parent / _record_name(token)}' to keep what is there now"
        )
        raise CheckpointError(msg)
    if final.exists():
        if _exchange(tmp, final):  # `final` is never missing
            os.rename(tmp, old)
        else:  # no atomic swap: rename aside, then in (a crash between is recovered)
            os.rename(final, old)
            os.rename(tmp, final)
    else:
        os.rename(tmp, final)


def _apply_record(record: pathlib.Path) -> str:
    """Finish the commit `record` describes (renames, fsyncs, cleanup); returns its id."""
    body = _read_record(record)
    token = body["checkpoint_id"]
    for tmp, final, inode in body["pairs"]:
        _put_in_place(tmp, final, inode, token)
    for parent in sorted({final.parent for _, final, _ in body["pairs"]}):
        _fsync_path(parent)  # the renames are durable before the record goes
    for _, final, _ in body["pairs"]:
        shutil.rmtree(_old_for(final, token), ignore_errors=True)
    for other in body["records"]:
        if other != record:
            other.unlink(missing_ok=True)
    record.unlink(missing_ok=True)  # last: while it exists, a recovery still finds this save
    for parent in sorted({r.parent for r in body["records"]}):
        if parent.is_dir():
            _fsync_path(parent)
    return token


def _records_in(dirs: Sequence[pathlib.Path]) -> list[pathlib.Path]:
    return [
        p
        for d in sorted(set(dirs))
        if d.is_dir()
        for p in sorted(d.glob(f"{COMMIT_RECORD_PREFIX}*.json"))
    ]


def recover_checkpoint_commits(dirs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Finish every save whose commit record lies in one of `dirs`; returns their checkpoint ids.

    A record is written only once all of its save's folders are complete, so the save is rolled
    forward: its remaining folders are renamed into place and the replaced copies deleted.
    Idempotent, safe to run at any time (it locks the folders against a commit in progress).
    Not collective: run it on one rank (`load_checkpoint` and `save_checkpoint` use rank 0).

    Raises:
        CheckpointError: a record is unreadable, or a folder it names was moved away by hand.
    """
    paths = [pathlib.Path(d) for d in dirs]
    found = _records_in(paths)
    parts = [p for d in paths if d.is_dir() for p in d.glob(f"{COMMIT_RECORD_PREFIX}*.json.part")]
    if not found and not parts:
        return []
    lock = set(paths)
    for record in found:  # also lock the other folders a record touches
        with contextlib.suppress(FileNotFoundError):  # finished meanwhile by its writer
            lock.update(r.parent for r in _read_record(record)["records"])
    done = []
    with _locked(sorted(lock)):
        for record in _records_in(paths):
            if not record.is_file():  # removed as another record's copy
                continue
            if {r.parent for r in _read_record(record)["records"]} <= lock:
                done.append(_apply_record(record))
            # else: a commit that started after the scan; its writer holds those folders
        for d in paths:
            if d.is_dir():
                for part in d.glob(f"{COMMIT_RECORD_PREFIX}*.json.part"):
                    part.unlink(missing_ok=True)  # a record whose write never finished
    return done


def _clear_stale(final: pathlib.Path) -> None:
    """Remove `<final>.tmp-*` / `<final>.old-*` leftovers: saves that died before their commit
    record (never committed) and copies a finished commit replaced. Run after recovery."""
    if not final.parent.is_dir():
        return
    for p in final.parent.iterdir():
        if p.name.startswith((f"{final.name}.tmp-", f"{final.name}.old-")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _on_rank0(parallel: Any, what: str, fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0 while the other ranks wait; every rank raises if it failed."""
    error: Exception | None = None
    if parallel.rank == 0:
        try:
            fn()
        except Exception as exc:  # re-raised below, after the other ranks learn of it
            error = exc
    if _all_ranks_max(parallel, int(error is not None)):
        if error is not None:
            raise error
        msg = f"rank 0 could not {what} (see its error)"
        raise RuntimeError(msg)


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


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


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
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        msg = (
            f"checkpoint file {str(path)!r} is {size} bytes but its header needs {8 + n + end}; "
            f"it is truncated (an interrupted save or copy) -- load another checkpoint"
        )
        raise CheckpointError(msg)
    return header


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
        weight_map = json.loads(index.read_text())["weight_map"]
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
    return path if path.name == MODEL_DIR or not (path / MODEL_DIR).is_dir() else path / MODEL_DIR


# ------------------------------------------------------------------------------ async saver


class AsyncSaver:
    """Pending writes of one worker: a background thread and the folders it will commit."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._commits: list[tuple[pathlib.Path, pathlib.Path]] = []
        self.group: Any = None  # gloo group for DCP's collectives off the main thread
        self.last_reference: tuple[pathlib.Path, tuple[Any, ...]] | None = None

    @property
    def pending(self) -> bool:
        return bool(self._commits)

    def start(
        self,
        jobs: Sequence[Callable[[], None]],
        commits: Sequence[tuple[pathlib.Path, pathlib.Path]],
        *,
        background: bool,
    ) -> None:
        self._commits = list(commits)
        self._error = None

        def run() -> None:
            try:
                for job in jobs:
                    job()
            except BaseException as exc:  # re-raised by finalize on the caller's thread
                self._error = exc

        if background:
            self._thread = threading.Thread(
                target=run, name="policyworker-checkpoint", daemon=False
            )
            self._thread.start()
        else:
            run()

    def finalize(self, parallel: Any, *, timeout_s: float = FINALIZE_TIMEOUT_S) -> None:
        """Wait for the writes, agree over all ranks that they landed, then rank 0 renames."""
        if not self._commits:
            return
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                msg = (
                    f"checkpoint writes did not finish within {timeout_s} s;"
                    " the disk is stalled or too slow"
                )
                raise TimeoutError(msg)
        self._thread = None
        error, commits, self._commits = self._error, self._commits, []
        failed = _all_ranks_max(parallel, int(error is not None))
        if failed:
            if parallel.rank == 0:
                for tmp, _ in commits:
                    shutil.rmtree(tmp, ignore_errors=True)
            if error is not None:
                raise error
            msg = "checkpoint writes failed on another rank; nothing was renamed into place"
            raise RuntimeError(msg)
        _on_rank0(parallel, "commit the checkpoint folders", lambda: _commit(commits))


def _commit(commits: Sequence[tuple[pathlib.Path, pathlib.Path]]) -> None:
    """fsync every temporary folder, write the commit records, then rename into place."""
    for tmp, _ in commits:
        _fsync_tree(tmp)
    token = commits[0][0].name.rsplit(".tmp-", 1)[1]
    with _locked([final.parent for _, final in commits]):
        records = _write_commit_records(token, commits)
        _apply_record(records[0])


def _all_ranks_max(parallel: Any, value: int) -> int:
    if parallel.world_size == 1:
        return value
    return parallel.all_reduce_int(value, op="max", axis="world")


_SAVERS: weakref.WeakKeyDictionary[Any, AsyncSaver] = weakref.WeakKeyDictionary()


def _saver(worker: Any) -> AsyncSaver:
    saver = _SAVERS.get(worker)
    if saver is None:
        saver = _SAVERS[worker] = AsyncSaver()
    return saver


def _checkpoint_group(worker: Any, saver: AsyncSaver) -> Any:
    """A gloo group for DCP (None in a single process): its collectives may run off-thread."""
    if not dist.is_initialized():
        return None
    if saver.group is None:
        saver.group = dist.new_group(backend="gloo")
    return saver.group


def _shared_token(parallel: Any) -> str:
    """A random hex token equal on every rank (from the OS, so no RNG state is consumed)."""
    value = secrets.randbits(48) if parallel.rank == 0 else 0
    if parallel.world_size > 1:
        value = parallel.all_reduce_int(value, op="sum", axis="world")
    return f"{value:012x}"


def _tmp_for(final: pathlib.Path, token: str) -> pathlib.Path:
    return final.with_name(f"{final.name}.tmp-{token}")


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
    layout = hf_layout(_specs({k: live[k] for k in values}), tie_word_embeddings=tie_word_embeddings(model))
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
    layout = hf_layout(_specs(live), tie_word_embeddings=tie_word_embeddings(model))
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


def _load_dcp_weights(model: nn.Module, folder: pathlib.Path, *, group: Any) -> Callable[[], None]:
    """Read a DCP weights folder (keys = canonical state names) into staging; returns the commit."""
    import torch.distributed.checkpoint as dcp

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
        staging[name] = _clone_to(t.detach(), device=None)
    dcp.load(
        staging,
        storage_reader=dcp.FileSystemReader(str(folder)),
        process_group=group,
        no_dist=group is None,
    )

    def commit() -> None:
        with torch.no_grad():
            for key, t in live.items():
                t.detach().copy_(staging[canonical_name(key)])

    return commit


def _dcp_keys(folder: pathlib.Path) -> set[str]:
    """Flattened keys of a DCP folder, after checking every data file it references is complete."""
    import torch.distributed.checkpoint as dcp

    if not (folder / ".metadata").is_file():
        msg = (
            f"DCP checkpoint file {str(folder / '.metadata')!r} does not exist;"
            " the save did not finish -- load another checkpoint"
        )
        raise CheckpointError(msg)
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:
        msg = (
            f"DCP checkpoint file {str(folder / '.metadata')!r} cannot be read ({exc});"
            " it is truncated or corrupt"
        )
        raise CheckpointError(msg) from exc
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


# ------------------------------------------------------------------------------ optimizer


def _clone_to(t: Any, *, device: str | None = "cpu") -> Any:
    """A detached copy (DTensors stay DTensors with a copied local shard)."""
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import DTensor

        local = t.to_local().detach()
        local = local.to(device, copy=True) if device else local.clone()
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t.detach().to(device, copy=True) if device else t.detach().clone()


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


def _from_bytes(value: Any) -> Any:
    raw = value.getvalue() if isinstance(value, io.BytesIO) else value
    return torch.load(io.BytesIO(raw), weights_only=True)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(_tuples(state["python"])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(obj: Any) -> Any:
    return tuple(_tuples(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def save_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    folder: pathlib.Path,
    *,
    parallel: Any,
    group: Any,
    meta: Mapping[str, Any],
) -> Callable[[], None]:
    """Stage optimizer + scheduler + this rank's RNG as a DCP state dict; returns the writer job."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any] = {}
    if optimizer.state:  # get_optimizer_state_dict would run a zero step on an empty optimizer
        state["optim"] = _tree_map(get_optimizer_state_dict(model, optimizer), _clone_to)
    extra = {
        "meta": dict(meta),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "fresh_optimizer": None if optimizer.state else optimizer.state_dict(),
    }
    state["extra"] = _to_bytes(extra)
    state[f"rng_rank{parallel.rank}"] = _to_bytes(_rng_state())
    folder.mkdir(parents=True, exist_ok=True)

    def job() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", UserWarning
            )  # "assuming single process" without a group
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(folder)),
                process_group=group,
                no_dist=group is None,
            )

    return job


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    optimizer_path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    parallel: Any = None,
    group: Any = None,
    restore_rng: bool = True,
) -> Callable[[], None]:
    """Read `optimizer_path/optim` (any layout) into staging; returns the commit.

    The commit loads optimizer and scheduler state and, when this rank's RNG state was saved,
    the torch/python RNG.

    Raises:
        ValueError: `model` is None (optimizer state is keyed by the model's parameter names).
        CheckpointError: the folder is missing or incomplete.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if model is None:
        msg = (
            "load_optimizer needs model=<the nn.Module the optimizer trains> to map state to "
            "parameter names"
        )
        raise ValueError(msg)
    folder = _optim_folder(optimizer_path)
    keys = _dcp_keys(folder)
    rank = 0 if parallel is None else parallel.rank
    request: dict[str, Any] = {"extra": io.BytesIO()}
    if f"rng_rank{rank}" in keys and restore_rng:
        request[f"rng_rank{rank}"] = io.BytesIO()
    has_optim = any(k.startswith("optim.") for k in keys)
    if has_optim:
        request["optim"] = _tree_map(
            get_optimizer_state_dict(model, optimizer), lambda t: _clone_to(t, device=None)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming single process" without a group
        dcp.load(
            request,
            storage_reader=dcp.FileSystemReader(str(folder)),
            process_group=group,
            no_dist=group is None,
        )
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


def _optim_folder(optimizer_path: str | os.PathLike[str]) -> pathlib.Path:
    path = pathlib.Path(optimizer_path)
    if path.name != OPTIM_DIR and (path / OPTIM_DIR).is_dir():
        return path / OPTIM_DIR
    if path.name == OPTIM_DIR or (path / ".metadata").is_file():
        return path
    msg = (
        f"no optimizer checkpoint at {str(path)!r}: expected '{OPTIM_DIR}/.metadata' under it"
        + _interrupted_hint(path / OPTIM_DIR)
    )
    raise CheckpointError(msg)


# ------------------------------------------------------------------------------ worker API


def _lora(worker: Any) -> bool:
    from policyworker.shell.lora import lora_modules

    return bool(lora_modules(worker.model))


def _reference(worker: Any) -> dict[str, torch.Tensor] | None:
    return getattr(worker, "_reference_state", None)


def _fingerprint(ref: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    return (id(ref),) + tuple((k, v.data_ptr(), v._version) for k, v in ref.items())


def _link_reference(src: pathlib.Path, dst: pathlib.Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def save_checkpoint(
    worker: Any,
    weights_path: str | os.PathLike[str],
    optimizer_path: str | os.PathLike[str] | None = None,
    tokenizer_path: str | os.PathLike[str] | None = None,
    *,
    is_final_checkpoint: bool = False,
) -> None:
    """Save weights (HF / PEFT), reference, optimizer and tokenizer; async unless final.

    Collective. Finalizes the previous save first. Returns once this rank's state is staged;
    `finalize_async_save` (or the next save) waits and renames every folder into place.

    Raises:
        ValueError: optimizer_path without an optimizer, or tokenizer_path without a tokenizer.
    """
    if optimizer_path is not None and worker.optimizer is None:
        msg = (
            "save_checkpoint(optimizer_path=...) but the worker has no optimizer "
            "(init_optimizer=False); pass optimizer_path=None"
        )
        raise ValueError(msg)
    if tokenizer_path is not None and worker.tokenizer is None:
        msg = (
            "save_checkpoint(tokenizer_path=...) but the worker has no tokenizer (model "
            "folder without tokenizer files); pass tokenizer_path=None"
        )
        raise ValueError(msg)
    saver, parallel = _saver(worker), worker.parallel
    saver.finalize(parallel)
    token = _shared_token(parallel)
    group = _checkpoint_group(worker, saver)
    meta = {
        "format_version": FORMAT_VERSION,
        "checkpoint_id": token,
        "world_size": parallel.world_size,
        "dp_size": parallel.dp_size,
        "tp_size": parallel.tp_size,
    }
    finals = [pathlib.Path(weights_path) / MODEL_DIR]
    if optimizer_path is not None:
        finals.append(pathlib.Path(optimizer_path) / OPTIM_DIR)
    if tokenizer_path is not None:
        finals.append(pathlib.Path(tokenizer_path))
    lora, ref = _lora(worker), _reference(worker)
    if ref is not None and not lora:
        finals.append(pathlib.Path(weights_path) / REFERENCE_DIR)

    def prepare() -> None:  # finish a committed save first: cleanup would delete its folders
        for final in finals:
            final.parent.mkdir(parents=True, exist_ok=True)
        parents = sorted({f.parent for f in finals})
        recover_checkpoint_commits(parents)
        with _locked(parents):
            for final in finals:
                _clear_stale(final)

    _on_rank0(parallel, "prepare the checkpoint folders", prepare)
    commits = [(_tmp_for(f, token), f) for f in finals]
    tmp = dict(zip(finals, (t for t, _ in commits), strict=True))
    jobs = []
    model_tmp = tmp[finals[0]]
    if lora:
        from policyworker.shell.lora import save_peft_adapter

        cfg = getattr(worker, "cfg", None)
        save_peft_adapter(
            worker.model,
            model_tmp,
            lora_cfg=getattr(getattr(cfg, "dtensor_cfg", None), "lora_cfg", None),
            base_model_name_or_path=getattr(cfg, "model_name", None),
            write=parallel.rank == 0,
        )
        if parallel.rank == 0:
            _write_json(model_tmp / MANIFEST_FILE, {**meta, "kind": "peft"})
    else:
        jobs.append(
            save_hf_weights(
                worker.model, model_tmp, parallel=parallel, manifest={**meta, "kind": "hf"}
            )
        )
    if ref is not None and not lora:
        jobs += _save_reference(
            worker,
            saver,
            ref,
            pathlib.Path(weights_path) / REFERENCE_DIR,
            tmp[pathlib.Path(weights_path) / REFERENCE_DIR],
        )
    if optimizer_path is not None:
        jobs.append(
            save_optimizer(
                worker.model,
                worker.optimizer,
                worker.scheduler,
                tmp[pathlib.Path(optimizer_path) / OPTIM_DIR],
                parallel=parallel,
                group=group,
                meta=meta,
            )
        )
    if tokenizer_path is not None and parallel.rank == 0:
        worker.tokenizer.save_pretrained(tmp[pathlib.Path(tokenizer_path)])
    saver.start(jobs, commits, background=not is_final_checkpoint)
    if is_final_checkpoint:
        saver.finalize(parallel)


def _save_reference(
    worker: Any,
    saver: AsyncSaver,
    ref: Mapping[str, torch.Tensor],
    final: pathlib.Path,
    tmp: pathlib.Path,
) -> list[Callable[[], None]]:
    """Hard-link the last save's reference files while the reference is unchanged, else write."""
    parallel = worker.parallel
    fp = _fingerprint(ref)
    last = saver.last_reference
    can_link = int(last is not None and last[1] == fp and (last[0] / INDEX_FILE).is_file())
    can_link = -_all_ranks_max(parallel, -can_link)  # min over ranks
    saver.last_reference = (final, fp)
    if can_link:
        assert last is not None
        return [lambda: _link_reference(last[0], tmp)] if parallel.rank == 0 else []
    return [save_hf_weights(worker.model, tmp, parallel=parallel, state=ref, write_config=False)]


def finalize_async_save(worker: Any, *, timeout_s: float = FINALIZE_TIMEOUT_S) -> None:
    """Block until every write of the last save landed and its folders are renamed into place."""
    _saver(worker).finalize(worker.parallel, timeout_s=timeout_s)


def _manifest_id(folder: pathlib.Path) -> str | None:
    path = folder / MANIFEST_FILE
    return json.loads(path.read_text()).get("checkpoint_id") if path.is_file() else None


def _record_dirs(weights_path: Any, optimizer_path: Any) -> list[pathlib.Path]:
    """Folders where a save of these paths keeps its commit records."""
    dirs = []
    for path, sub in ((weights_path, MODEL_DIR), (optimizer_path, OPTIM_DIR)):
        if path is not None:
            path = pathlib.Path(path)
            dirs += [path, path.parent] if path.name == sub else [path]
    return dirs


def _load(worker: Any, weights_path: Any, optimizer_path: Any, *, load_weights: bool) -> None:
    saver, parallel = _saver(worker), worker.parallel
    saver.finalize(parallel)
    _on_rank0(
        parallel,
        "recover an interrupted checkpoint commit",
        lambda: recover_checkpoint_commits(_record_dirs(weights_path, optimizer_path)),
    )
    group = _checkpoint_group(worker, saver)
    commits: list[Callable[[], None]] = []
    weights_id = None
    if weights_path is not None:
        folder = _model_folder(weights_path)
        fmt = detect_weights_format(weights_path)
        weights_id = _manifest_id(folder)
        if load_weights and fmt == "safetensors":
            commits.append(load_hf_weights(worker.model, folder, parallel=parallel))
        elif load_weights and fmt == "dcp":
            commits.append(_load_dcp_weights(worker.model, folder, group=group))
        elif load_weights:
            from policyworker.shell.lora import load_peft_adapter

            commits.append(lambda: load_peft_adapter(worker.model, folder))
        ref_folder = folder.parent / REFERENCE_DIR if folder.name == MODEL_DIR else None
        ref = _reference(worker)
        if ref is not None and ref_folder is not None and ref_folder.is_dir():
            commits.append(load_hf_weights(worker.model, ref_folder, parallel=parallel, state=ref))
            saver.last_reference = None
    if optimizer_path is not None:
        if worker.optimizer is None:
            msg = (
                "load_checkpoint(optimizer_path=...) but the worker has no optimizer "
                "(init_optimizer=False); pass optimizer_path=None"
            )
            raise ValueError(msg)
        commit = load_optimizer(
            worker.optimizer,
            worker.scheduler,
            optimizer_path,
            model=worker.model,
            parallel=parallel,
            group=group,
        )
        saved_id = getattr(commit, "checkpoint_id", None)
        if weights_id is not None and saved_id is not None and saved_id != weights_id:
            msg = (
                f"weights {str(weights_path)!r} (checkpoint id {weights_id}) and optimizer "
                f"{str(optimizer_path)!r} (id {saved_id}) come from different saves; pass the "
                f"optimizer_path saved together with these weights"
            )
            raise CheckpointError(msg)
        commits.append(commit)
    for commit in commits:
        commit()


def load_checkpoint(
    worker: Any,
    weights_path: str | os.PathLike[str],
    optimizer_path: str | os.PathLike[str] | None = None,
) -> None:
    """Load weights (safetensors / DCP / PEFT, any layout), the saved reference, optimizer state.

    Collective. Validates and reads everything before changing the worker: a missing or
    truncated file raises `CheckpointError` naming it and leaves the worker as it was.
    """
    _load(worker, weights_path, optimizer_path, load_weights=True)


def load_checkpoint_at_init(
    worker: Any,
    weights_path: str | os.PathLike[str] | None = None,
    optimizer_path: str | os.PathLike[str] | None = None,
    *,
    weights_loaded: bool = False,
) -> None:
    """The constructor's loader: call after the optimizer and the reference snapshot exist.

    `weights_loaded=True` when the constructor already built the model from `weights_path`
    (an HF folder); then only the saved reference and the optimizer state are restored.
    """
    if weights_path is None and optimizer_path is None:
        return
    _load(worker, weights_path, optimizer_path, load_weights=not weights_loaded)

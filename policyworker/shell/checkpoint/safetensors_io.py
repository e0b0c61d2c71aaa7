"""Saving HF safetensors weights: staged per rank, `pwrite`n at planned offsets.

Every rank writes the bytes of the boxes its local shard owns at offsets that every rank
computes identically (`layout.plan_safetensors_files`); a load validates headers and names
before it changes any parameter and returns a commit function that copies the staged values.

A sync save stages nothing: device pieces stay on the device and each writer thread copies its
runs out in `bounce.BOUNCE_BYTES` chunks through its own page-locked buffer and CUDA stream
(`bounce.Bounce`), then `pwrite`s the chunk, so device-to-host copies overlap the other threads'
disk writes instead of all running before the first write; CPU pieces are written from where
they are.

The load side is `safetensors_load`.
"""

from __future__ import annotations

import copy
import itertools
import os
import pathlib
import queue
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
from torch import nn

import policyworker.shell.checkpoint.bounce as bounce
import policyworker.shell.checkpoint.digests as digests_io
import policyworker.shell.checkpoint.layout as checkpoint_layout_settings
from policyworker.functional.safetensors_layout import (
    FilePlan,
    HFTensor,
    contiguous_runs,
    file_bytes_for_parallel_writes,
    intersect_boxes,
    itemsize,
    plan_safetensors_files,
)
from policyworker.shell.checkpoint.commit import _write_json
from policyworker.shell.checkpoint.layout import (
    INDEX_FILE,
    MANIFEST_FILE,
    _Local,
    _locals,
    _model_state,
    _specs,
    hf_layout,
    saved_keys,
)
from policyworker.shell.refit.hf_names import checkpoint_layout
from policyworker.shell.refit.weight_stream import tie_word_embeddings

if TYPE_CHECKING:
    from policyworker.shell.checkpoint.saver import StagingBuffers

__all__ = ["model_hf_layout", "save_hf_weights"]


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
    tensor: torch.Tensor  # contiguous copy of the intersection (a sync save: maybe on device)
    runs: list[tuple[int, tuple[int, ...], int]]  # (byte offset in file, leading idx, elements)
    # A sync save's device piece: recorded on the caller's stream after the values were final;
    # the writer's copy stream waits on it (the optimizer step's kernels may still be queued).
    ready: Any = None


def _stage_hf(
    locals_: Mapping[str, _Local],
    layout: Sequence[HFTensor],
    plans: Sequence[FilePlan],
    staging: StagingBuffers | None = None,
    *,
    copy_sources: bool = True,
) -> list[_Piece]:
    """The parts of each HF tensor this rank owns, to write, with their file offsets.

    With `staging`, CPU copies go into its reused "weights" buffers (queued; the caller waits);
    without, into fresh CPU tensors, or (``copy_sources=False``: a synchronous save, whose writes
    end before the caller can change anything) nothing is copied: CPU sources are written from
    where they are and device sources are copied out chunk by chunk by the writer threads.
    """
    where = {name: (p.file, off) for p in plans for name, off in p.offsets.items()}
    views, pieces = [], []
    for t in layout:
        local = locals_[t.key]
        if not local.owner:
            continue
        sub = intersect_boxes(t.box, local.box)
        if sub is None:
            continue
        view = local.tensor[
            tuple(slice(a - lb, b - lb) for (a, b), (lb, _) in zip(sub, local.box, strict=True))
        ]
        file, base = where[t.name]
        size = itemsize(t.dtype)
        runs = [(base + off * size, idx, n) for off, idx, n in contiguous_runs(sub, t.box)]
        views.append(((t.name, sub), view.detach()))
        pieces.append(_Piece(file, view, runs))
    if staging is not None:
        copies = staging.stage("weights", views)
    elif copy_sources:
        copies = [view.to("cpu", copy=True).contiguous() for _, view in views]
    else:
        copies = [view.contiguous() for _, view in views]  # on its device
    ready = _ready_events(copies) if staging is None and not copy_sources else {}
    for piece, copied in zip(pieces, copies, strict=True):
        piece.tensor = copied
        piece.ready = ready.get(copied.device)
    return pieces


def _ready_events(tensors: Sequence[torch.Tensor]) -> dict[torch.device, Any]:
    """One event per CUDA device, recorded on its current stream: the point after which the
    writer threads' copy streams may read the values."""
    events = {}
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events[device] = event
    return events


def _chunks(
    fd: int, flat: torch.Tensor, offset: int, ready: Any
) -> list[tuple[int, torch.Tensor, int, Any]]:
    """One run as writer tasks: whole on the CPU (zero-copy pwrite); through the bounce buffer,
    in pieces of at most `bounce.BOUNCE_BYTES` bytes at their own file offsets."""
    if not bounce.bounced(flat):
        return [(fd, flat, offset, None)]
    raw = flat.view(torch.uint8)
    return [
        (fd, raw[start : start + bounce.BOUNCE_BYTES], offset + start, ready)
        for start in range(0, raw.numel(), bounce.BOUNCE_BYTES)
    ]


# A writer task: (fd, its bytes: a 1-D tensor, or a file header in host memory, file offset,
# the CUDA event a device tensor's values are ready at)
_Task = tuple[int, torch.Tensor | memoryview, int, Any]
# A unit of one writer thread's work: the tasks of one file in offset order, and the file and
# piece index whose digest they make (None: the file is not hashed as it is written)
_Group = tuple[list[_Task], tuple[str, int] | None]


def _write_groups(
    groups: queue.SimpleQueue[_Group],
    digests: dict[tuple[str, int], tuple[bytes, int]],
    new_piece: Callable[[], Any],
) -> None:
    """One writer thread: take groups until none are left; device runs go through its own
    bounce buffer (allocated on the first one, freed on return). A hashed group is one 64 MiB
    piece of its file, written front to back: its bytes are hashed as they are written."""
    own = bounce.Bounce()
    try:
        while True:
            try:
                tasks, piece = groups.get_nowait()
            except queue.Empty:
                return
            hasher, hashed = None if piece is None else new_piece(), 0
            for fd, data, offset, ready in tasks:
                if isinstance(data, memoryview):  # a header
                    raw = data
                else:
                    raw = _bytes_of(own.copy_out(data, ready) if bounce.bounced(data) else data)
                _pwrite_all(fd, raw, offset)
                if hasher is not None:
                    hasher.update(raw)
                    hashed += len(raw)
            if piece is not None and hasher is not None:
                digests[piece] = bytes(hasher.digest()), hashed
    finally:
        own.release()


def _nbytes(data: torch.Tensor | memoryview) -> int:
    return len(data) if isinstance(data, memoryview) else data.numel() * data.element_size()


def _covers(tasks: Sequence[_Task], size: int) -> bool:
    """Whether the tasks write every byte of a `size`-byte file exactly once."""
    end = 0
    for _, data, offset, _ in sorted(tasks, key=lambda t: t[2]):
        if offset != end:
            return False
        end += _nbytes(data)
    return end == size


def _piece_groups(tasks: Sequence[_Task], size: int, piece_bytes: int) -> list[list[_Task]]:
    """The tasks (covering the file) cut at the digest's piece boundaries, per piece in order."""
    groups: list[list[_Task]] = [[] for _ in range(max(1, -(-size // piece_bytes)))]
    for fd, data, offset, ready in sorted(tasks, key=lambda t: t[2]):
        raw = data if isinstance(data, memoryview) else data.view(torch.uint8)
        start, nbytes = 0, _nbytes(raw)
        while start < nbytes:
            k = (offset + start) // piece_bytes
            end = min(nbytes, (k + 1) * piece_bytes - offset)
            groups[k].append((fd, raw[start:end], offset + start, ready))
            start = end
    return groups


def _write_hf_files(
    folder: pathlib.Path,
    plans: Sequence[FilePlan],
    pieces: Sequence[_Piece],
    *,
    write_headers: bool,
) -> None:
    """pwrite this rank's staged pieces (and, on one rank, the headers) into the planned files,
    from ``WRITER_THREADS`` threads (the runs are disjoint byte ranges, so order is free). Device
    pieces (a sync save) are copied out in chunks by the thread that writes them.

    A file this rank writes whole (every byte: one rank, or one rank owning all its tensors) is
    hashed as it is written, one 64 MiB piece per task group, and its digest noted for the
    commit (`digests.record_written`), which then need not read it back."""
    algorithm = digests_io.save_algorithm()
    hashing = digests_io.TreeHasher(algorithm)
    fds: dict[str, int] = {}
    try:
        for plan in plans:
            fd = os.open(folder / plan.file, os.O_WRONLY | os.O_CREAT, 0o644)
            fds[plan.file] = fd
            if write_headers:
                os.ftruncate(fd, plan.size)
        per_file: dict[str, list[_Task]] = {p.file: [] for p in plans}
        for piece in pieces:
            for offset, idx, n in piece.runs:
                flat = (piece.tensor[idx] if idx else piece.tensor).reshape(-1)[:n]
                per_file[piece.file] += _chunks(fds[piece.file], flat, offset, piece.ready)
        hashed: dict[str, int] = {}  # file -> its number of pieces
        groups_per_file: list[list[_Group]] = []
        for plan in plans:
            tasks = per_file[plan.file]
            if write_headers:
                tasks = [(fds[plan.file], memoryview(plan.header).cast("B"), 0, None), *tasks]
            if write_headers and digests_io.HASH_WHILE_WRITING and _covers(tasks, plan.size):
                cut = _piece_groups(tasks, plan.size, hashing.piece_bytes)
                hashed[plan.file] = len(cut)
                groups_per_file.append([(g, (plan.file, k)) for k, g in enumerate(cut)])
            else:
                groups_per_file.append([([t], None) for t in tasks])
        # Queue one group of each file in turn, so the threads write different files at once:
        # writes to one file take turns on its inode lock (see WRITE_STREAMS).
        groups: queue.SimpleQueue[_Group] = queue.SimpleQueue()
        for turn in itertools.zip_longest(*groups_per_file):
            for group in turn:
                if group is not None:
                    groups.put(group)
        digests: dict[tuple[str, int], tuple[bytes, int]] = {}
        threads = max(1, checkpoint_layout_settings.WRITER_THREADS)
        with ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-write") as pool:
            # list(): the first failed write raises here, after the other threads finished
            list(pool.map(lambda _: _write_groups(groups, digests, hashing.piece), range(threads)))
            list(pool.map(os.fsync, fds.values()))
        for file, count in hashed.items():
            hashed_pieces = [digests[(file, k)] for k in range(count)]
            tree = hashing.hexdigest([digest for digest, _ in hashed_pieces])
            size = sum(nbytes for _, nbytes in hashed_pieces)  # the bytes they were hashed from
            digests_io.record_written(folder / file, tree, hasher=hashing, size=size)
    finally:
        for fd in fds.values():
            os.close(fd)


def _bytes_of(flat: torch.Tensor) -> memoryview:
    return flat.view(torch.uint8).numpy().data


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


# ------------------------------------------------------------------------------ weights


def _hf_class_name(model: nn.Module) -> str:
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__


def _as_local(value: torch.Tensor, like: _Local) -> torch.Tensor:
    """A reference/state value as this rank's local block of the live tensor `like`."""
    value = value.detach()
    if hasattr(value, "device_mesh"):
        dvalue = cast("DTensor", value)
        return dvalue.full_tensor() if like.gathered else dvalue.to_local()
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


def save_hf_weights(
    model: nn.Module,
    folder: pathlib.Path,
    *,
    parallel: Any,
    state: Mapping[str, torch.Tensor] | None = None,
    max_file_bytes: int | None = None,
    write_config: bool = True,
    manifest: Mapping[str, Any] | None = None,
    staging: StagingBuffers | None = None,
    copy_sources: bool = True,
) -> Callable[[], None]:
    """Stage this rank's share of an HF safetensors folder; returns the job that writes it.

    `state` (default: the live model state) supplies the values; shapes and placements come from
    the live model. Rank 0 writes config/index/manifest now; every rank's job `pwrite`s its bytes.
    With `staging` the copies are queued into its reused buffers: call `staging.wait()` before
    the job runs or the weights change. ``copy_sources=False`` (only for a job run before the
    weights can change) writes CPU weights without copying them first. ``max_file_bytes``
    (default: `file_bytes_for_parallel_writes` of the whole layout) caps each file's size.
    """
    live = _model_state(model)
    values = live if state is None else {k: state[k] for k in live if k in state}
    layout = model_hf_layout(model, _specs({k: live[k] for k in values}))
    if max_file_bytes is None:
        max_file_bytes = file_bytes_for_parallel_writes(sum(t.nbytes for t in layout))
    plans = plan_safetensors_files(layout, max_file_bytes=max_file_bytes)
    locals_ = _locals(live, rank=parallel.rank, world_size=parallel.world_size)
    if state is not None:
        locals_ = {
            k: attrs.evolve(locals_[k], tensor=_as_local(values[k], locals_[k])) for k in values
        }
    pieces = _stage_hf(locals_, layout, plans, staging, copy_sources=copy_sources)
    folder.mkdir(parents=True, exist_ok=True)
    if parallel.rank == 0:
        weight_map = {name: p.file for p in plans for name in p.offsets}
        total = sum(t.nbytes for t in layout)
        _write_json(
            folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
        model_config: Any = getattr(model, "config", None)
        if write_config and model_config is not None:
            config = copy.deepcopy(model_config)
            config.architectures = [_hf_class_name(model)]
            config.save_pretrained(folder)
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                gen.save_pretrained(folder)
        if manifest is not None:
            _write_json(folder / MANIFEST_FILE, dict(manifest))
    write_headers = parallel.rank == 0
    return lambda: _write_hf_files(folder, plans, pieces, write_headers=write_headers)

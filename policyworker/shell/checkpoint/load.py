"""The load side of a worker's checkpoint: recover, verify digests while reading, then commit.

A load checks every folder's digests in background threads while it reads the same files into
staging (the safetensors files and the DCP files each on several threads, the two folders side
by side), then commits (`load`): the files stream through the page cache once, and the worker
changes only after every read and every check passed. `CheckpointOwner` is what both the save
(`api`) and this load read from a worker.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from policyworker.shell.checkpoint.commit import _on_rank0, read_json, recover_checkpoint_commits
from policyworker.shell.checkpoint.dcp_load import (
    _load_dcp_weights,
    _optim_folder,
    load_optimizer,
)
from policyworker.shell.checkpoint.digests import DigestChecks
from policyworker.shell.checkpoint.folders import _model_folder, detect_weights_format
from policyworker.shell.checkpoint.layout import (
    MANIFEST_FILE,
    MODEL_DIR,
    OPTIM_DIR,
    REFERENCE_DIR,
    CheckpointError,
)
from policyworker.shell.checkpoint.safetensors_load import load_hf_weights
from policyworker.shell.checkpoint.saver import AsyncSaver, _checkpoint_group

__all__ = ["CheckpointOwner", "load"]


class CheckpointOwner(Protocol):
    """What the worker-level functions read and restore: a `shell.state.WorkerState`, or any
    object with these attributes (tests and benchmarks use small ones around a plain module)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    tokenizer: Any
    cfg: Any  # PolicyConfig or None: the LoRA config and model name of a PEFT adapter
    parallel: Any  # ParallelContext
    reference_state: dict[str, torch.Tensor] | None
    saver: AsyncSaver


def _lora(owner: CheckpointOwner) -> bool:
    from policyworker.shell.model.lora import lora_modules

    return bool(lora_modules(owner.model))


def _manifest_id(folder: pathlib.Path) -> str | None:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    manifest = read_json(path)
    return manifest.get("checkpoint_id") if isinstance(manifest, dict) else None


def _record_dirs(weights_path: Any, optimizer_path: Any) -> list[pathlib.Path]:
    """Folders where a save of these paths keeps its commit records."""
    dirs = []
    for path, sub in ((weights_path, MODEL_DIR), (optimizer_path, OPTIM_DIR)):
        if path is not None:
            path = pathlib.Path(path)
            dirs += [path, path.parent] if path.name == sub else [path]
    return dirs


def load(
    owner: CheckpointOwner,
    weights_path: Any,
    optimizer_path: Any,
    *,
    load_weights: bool,
    verify_digests: bool = True,
) -> None:
    """Verify every folder's digests while reading everything into staging, then commit.

    The digest checks (one background thread per folder) and the reads stream the same files
    once through the page cache instead of one after the other; nothing in the worker changes
    until both finished. When a read fails and a digest check fails too, the digest error wins:
    it names the file whose bytes changed, which is the cause of the read error.
    """
    saver, parallel = owner.saver, owner.parallel
    saver.finalize(parallel)
    _on_rank0(
        parallel,
        "recover an interrupted checkpoint commit",
        lambda: recover_checkpoint_commits(_record_dirs(weights_path, optimizer_path)),
    )
    group = _checkpoint_group(saver)
    folders = _digest_folders(owner, weights_path, optimizer_path) if verify_digests else []
    checks = DigestChecks(folders)
    try:
        commits = _read(owner, weights_path, optimizer_path, load_weights=load_weights, group=group)
    except (Exception, CheckpointException):  # DCP's is a BaseException
        checks.wait()  # raises the digest error instead, if there is one
        raise
    checks.wait()
    for commit in commits:
        commit()


def _digest_folders(
    owner: CheckpointOwner, weights_path: Any, optimizer_path: Any
) -> list[pathlib.Path]:
    """The folders `_read` reads, in its order (the first failing one is reported)."""
    folders = []
    if weights_path is not None:
        folder = _model_folder(weights_path)
        folders.append(folder)
        ref_folder = folder.parent / REFERENCE_DIR if folder.name == MODEL_DIR else None
        if owner.reference_state is not None and ref_folder is not None and ref_folder.is_dir():
            folders.append(ref_folder)
    if optimizer_path is not None and owner.optimizer is not None:
        # no optimizer folder: the read raises this same error in its turn
        with contextlib.suppress(CheckpointError):
            folders.append(_optim_folder(optimizer_path))
    return folders


def _read(
    owner: CheckpointOwner,
    weights_path: Any,
    optimizer_path: Any,
    *,
    load_weights: bool,
    group: Any,
) -> list[Callable[[], object]]:
    """Validate and read every folder into staging (digests unchecked); returns the commits.

    The safetensors reads (weights, reference) run on a thread beside the DCP reads on this one
    (optimizer; DCP-format weights), so the disk serves both folders at once; they use no
    collectives, so the process group sees only DCP's, in the same order on every rank. When
    both fail, the weights' error is raised, as when they were read first.
    """
    saver, parallel = owner.saver, owner.parallel
    commits: list[Callable[[], object]] = []
    file_reads: list[Callable[[], Callable[[], object]]] = []
    weights_id, dcp_weights, reads_reference = None, None, False
    if weights_path is not None:
        folder = _model_folder(weights_path)
        fmt = detect_weights_format(weights_path)
        if fmt == "peft" and not _lora(owner):
            msg = (
                f"{str(folder)!r} holds a LoRA adapter (adapter_config.json) but this worker has "
                f"no LoRA: its adapters would be added beside weights the optimizer does not "
                f"train. Build the worker with the same dtensor_cfg.lora_cfg to resume it, or "
                f"merge the adapter and load the merged weights"
            )
            raise CheckpointError(msg)
        weights_id = _manifest_id(folder)
        if load_weights and fmt == "safetensors":
            file_reads.append(lambda: load_hf_weights(owner.model, folder, parallel=parallel))
        elif load_weights and fmt == "dcp":
            dcp_weights = folder
        elif load_weights:
            from policyworker.shell.model.peft_adapter import load_peft_adapter

            commits.append(lambda: load_peft_adapter(owner.model, folder))
        ref_folder = folder.parent / REFERENCE_DIR if folder.name == MODEL_DIR else None
        ref = owner.reference_state
        if ref is not None and ref_folder is not None and ref_folder.is_dir():
            file_reads.append(
                lambda: load_hf_weights(owner.model, ref_folder, parallel=parallel, state=ref)
            )
            reads_reference = True
    if optimizer_path is not None and owner.optimizer is None:
        msg = (
            "load_checkpoint(optimizer_path=...) but the worker has no optimizer "
            "(init_optimizer=False); pass optimizer_path=None"
        )
        raise ValueError(msg)
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-read-weights") as pool:
        file_commits = pool.submit(lambda: [read() for read in file_reads])
        try:
            if dcp_weights is not None:
                commits.append(_load_dcp_weights(owner.model, dcp_weights, group=group))
            if optimizer_path is not None:
                commits.append(
                    _read_optimizer(owner, optimizer_path, weights_path, weights_id, group=group)
                )
        except (Exception, CheckpointException):  # DCP's is a BaseException
            file_commits.result()  # waits; the weights' error, if any, wins
            raise
    read_commits = file_commits.result()
    if reads_reference:  # the next save writes the reference instead of linking the old files
        saver.last_reference = None
    return read_commits + commits


def _read_optimizer(
    owner: CheckpointOwner,
    optimizer_path: Any,
    weights_path: Any,
    weights_id: str | None,
    *,
    group: Any,
) -> Callable[[], object]:
    """Read the optimizer folder (DCP) into staging; refuse one from another save's weights."""
    assert owner.optimizer is not None  # _read checked
    commit = load_optimizer(
        owner.optimizer,
        owner.scheduler,
        optimizer_path,
        model=owner.model,
        parallel=owner.parallel,
        group=group,
        verify=False,  # checked by _load, concurrently with this read
    )
    saved_id = getattr(commit, "checkpoint_id", None)
    if weights_id is not None and saved_id is not None and saved_id != weights_id:
        msg = (
            f"weights {str(weights_path)!r} (checkpoint id {weights_id}) and optimizer "
            f"{str(optimizer_path)!r} (id {saved_id}) come from different saves; pass the "
            f"optimizer_path saved together with these weights"
        )
        raise CheckpointError(msg)
    return commit

"""Checkpoints of a worker: save_checkpoint / load_checkpoint / finalize_async_save.

Layout (details in docs/checkpoints.md)::

    weights_path/model/       HF folder: config.json, generation_config.json,
                              model.safetensors.index.json, model-0000i-of-0000n.safetensors
                              (fp32 master weights), policyworker_checkpoint.json
                              -- or, for LoRA runs, a PEFT adapter folder
    weights_path/reference/   the ORIGINAL reference weights (same HF format; hard-linked
                              from the previous save while they are unchanged)
    optimizer_path/optim/     DCP: optimizer (sharded as trained), scheduler, RNG, checkpoint id
    tokenizer_path/           tokenizer.save_pretrained (rank 0)
    extra_folders             what the caller stages beside these (the co-trained draft:
                              weights_path/draft/, optimizer_path/draft/), committed with them

Weights never meet on one rank: every HF tensor is a box (a region) of one model tensor; each
rank owns the part of that box its local shard covers (replicas: the one at coordinate 0) and
`pwrite`s those bytes at offsets that every rank computes identically from the global shapes
(the safetensors header is a pure function of names, shapes and dtypes). Only placements other
than Shard/Replicate (e.g. the `_StridedShard` of 2-D TP+FSDP) fall back to a per-tensor gather.

Saves are asynchronous: the call returns after staging (a CPU copy of this rank's pieces, into
pinned buffers the saver keeps and reuses across async saves; see `saver.StagingBuffers` for
the memory this holds); a background thread writes; `finalize_async_save` waits, agrees over
all ranks that every write landed, and rank 0 commits: it fsyncs every `<final>.tmp-<token>`
folder, writes a commit record naming all of them, renames each into place and removes the
record. A crash after the record is rolled forward by the next load or save
(`recover_checkpoint_commits`), so weights and optimizer always come from one save.
A sync save (`is_final_checkpoint=True`) stages nothing: its writer threads copy device state
out as they write (see `saver`), so copies and disk writes overlap and no memory is kept.

A save writes its folders side by side (`saver.run_jobs_concurrently`). The load side (digest
checks beside the reads, then one commit) is in `load`.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policyworker.shell.checkpoint.commit import (
    _clear_stale,
    _locked,
    _on_rank0,
    _shared_token,
    _tmp_for,
    _write_json,
    recover_checkpoint_commits,
)
from policyworker.shell.checkpoint.dcp import save_optimizer
from policyworker.shell.checkpoint.layout import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_DIR,
    OPTIM_DIR,
    REFERENCE_DIR,
)
from policyworker.shell.checkpoint.load import CheckpointOwner, _lora, load
from policyworker.shell.checkpoint.reference import save_reference
from policyworker.shell.checkpoint.safetensors_io import save_hf_weights
from policyworker.shell.checkpoint.saver import (
    FINALIZE_TIMEOUT_S,
    AsyncSaver,
    StagingBuffers,
    _checkpoint_group,
)

__all__ = [
    "CheckpointOwner",
    "StageFolder",
    "finalize_async_save",
    "load_checkpoint",
    "load_checkpoint_at_init",
    "save_checkpoint",
]


# ------------------------------------------------------------------------------ worker API

# A stager of an extra checkpoint folder: given the folder to write, it copies what it saves
# (now, on the caller's thread) and returns the write job for the background thread, or None.
StageFolder = Callable[[pathlib.Path], Callable[[], None] | None]


def save_checkpoint(
    owner: CheckpointOwner,
    weights_path: str | os.PathLike[str],
    optimizer_path: str | os.PathLike[str] | None = None,
    tokenizer_path: str | os.PathLike[str] | None = None,
    *,
    is_final_checkpoint: bool = False,
    extra_folders: Mapping[pathlib.Path, StageFolder] | None = None,
) -> None:
    """Save weights (HF / PEFT), reference, optimizer and tokenizer; async unless final.

    Collective. Finalizes the previous save first. Returns once this rank's state is staged;
    `finalize_async_save` (or the next save) waits and renames every folder into place.
    `extra_folders` maps more final folders to their stagers: each is called on every rank
    with its temporary folder, right here, and returns this rank's write job (or None); the
    folders are committed with the others.

    Raises:
        ValueError: optimizer_path without an optimizer, or tokenizer_path without a tokenizer.
    """
    _check_save_args(owner, optimizer_path, tokenizer_path)
    saver, parallel = owner.saver, owner.parallel
    saver.finalize(parallel)
    token = _shared_token(parallel)
    meta = {
        "format_version": FORMAT_VERSION,
        "checkpoint_id": token,
        "world_size": parallel.world_size,
        "dp_size": parallel.dp_size,
        "tp_size": parallel.tp_size,
    }
    lora, ref = _lora(owner), owner.reference_state
    weights = pathlib.Path(weights_path)
    reference = weights / REFERENCE_DIR if ref is not None and not lora else None
    optim = pathlib.Path(optimizer_path) / OPTIM_DIR if optimizer_path is not None else None
    tokenizer = pathlib.Path(tokenizer_path) if tokenizer_path is not None else None
    finals = [f for f in (weights / MODEL_DIR, optim, tokenizer, reference) if f is not None]
    finals += list(extra_folders or {})
    commits = [(_tmp_for(f, token), f) for f in finals]
    tmp = dict(zip(finals, (t for t, _ in commits), strict=True))
    _on_rank0(
        parallel,
        "prepare the checkpoint folders",
        lambda: _prepare_folders(finals, list(tmp.values()), saver),
    )
    try:
        jobs = _stage(
            owner,
            tmp,
            meta,
            reference=reference,
            optim=optim,
            tokenizer=tokenizer,
            extra_folders=extra_folders or {},
            sync=is_final_checkpoint,
        )
        saver.staging.wait()  # every copy landed: training may change the weights once we return
    except BaseException:  # Ctrl-C or a failure while staging: no folder of it stays behind
        saver.discard_staged()
        raise
    saver.start(jobs, commits, background=not is_final_checkpoint)
    if is_final_checkpoint:
        saver.finalize(parallel)


def _stage(
    owner: CheckpointOwner,
    tmp: Mapping[pathlib.Path, pathlib.Path],
    meta: Mapping[str, Any],
    *,
    reference: pathlib.Path | None,
    optim: pathlib.Path | None,
    tokenizer: pathlib.Path | None,
    extra_folders: Mapping[pathlib.Path, StageFolder],
    sync: bool,
) -> list[Callable[[], None]]:
    """Stage every folder of one save into its temporary folder; returns the write jobs."""
    saver, parallel, ref = owner.saver, owner.parallel, owner.reference_state
    group = _checkpoint_group(saver)
    finals = list(tmp)
    # async: copies into the saver's reused (pinned) buffers, waited for below; sync: the jobs
    # run inside this call, so CPU state is written where it is and device state is copied out
    # through the writer threads' bounce buffers as they write, unless an async save already
    # holds buffers: copying into them at pinned bandwidth and writing from host memory is a
    # little faster (the final save of a loop that saved asynchronously; H200, 1.5B + AdamW,
    # same run: 11.4 s from staging, 12.0 s through the bounce buffers)
    reuse_staging = not sync or saver.staging.nbytes > 0
    staging = saver.staging if reuse_staging else None
    jobs = _model_jobs(owner, tmp[finals[0]], meta, lora=_lora(owner), staging=staging, sync=sync)
    if reference is not None and ref is not None:  # reference is set only with ref
        jobs += save_reference(owner.model, owner.parallel, saver, ref, reference, tmp[reference])
    if optim is not None and owner.optimizer is not None:  # _check_save_args: both or neither
        jobs.append(
            save_optimizer(
                owner.model,
                owner.optimizer,
                owner.scheduler,
                tmp[optim],
                parallel=parallel,
                group=group,
                meta=meta,
                staging=staging,
                copy_sources=not sync,
            )
        )
    if tokenizer is not None and parallel.rank == 0:
        owner.tokenizer.save_pretrained(tmp[tokenizer])
    for final, stage in extra_folders.items():
        job = stage(tmp[final])
        if job is not None:
            jobs.append(job)
    return jobs


def _check_save_args(owner: CheckpointOwner, optimizer_path: Any, tokenizer_path: Any) -> None:
    """Refuse to save state the owner does not have, before any folder changes."""
    if optimizer_path is not None and owner.optimizer is None:
        msg = (
            "save_checkpoint(optimizer_path=...) but the worker has no optimizer "
            "(init_optimizer=False); pass optimizer_path=None"
        )
        raise ValueError(msg)
    if tokenizer_path is not None and owner.tokenizer is None:
        msg = (
            "save_checkpoint(tokenizer_path=...) but the worker has no tokenizer (model "
            "folder without tokenizer files); pass tokenizer_path=None"
        )
        raise ValueError(msg)


def _prepare_folders(
    finals: Sequence[pathlib.Path], tmps: Sequence[pathlib.Path], saver: AsyncSaver
) -> None:
    """Rank 0: finish a committed save first (cleanup would delete its folders), clear what
    interrupted saves left next to the final folders (never another live save's staged folders),
    then create and claim this save's staged folders."""
    for final in finals:
        final.parent.mkdir(parents=True, exist_ok=True)
    parents = sorted({f.parent for f in finals})
    recover_checkpoint_commits(parents)
    with _locked(parents):
        for final in finals:
            _clear_stale(final)
        saver.claim(tmps)


def _model_jobs(
    owner: CheckpointOwner,
    model_tmp: pathlib.Path,
    meta: Mapping[str, Any],
    *,
    lora: bool,
    staging: StagingBuffers | None,
    sync: bool,
) -> list[Callable[[], None]]:
    """The model's write jobs: HF safetensors, or (LoRA runs) a PEFT adapter written now.

    `sync`: the jobs run before `save_checkpoint` returns, so CPU weights need no copy first.
    """
    if not lora:
        manifest = {**meta, "kind": "hf"}
        job = save_hf_weights(
            owner.model,
            model_tmp,
            parallel=owner.parallel,
            manifest=manifest,
            staging=staging,
            copy_sources=not sync,
        )
        return [job]
    from policyworker.shell.model.peft_adapter import save_peft_adapter

    cfg = getattr(owner, "cfg", None)
    save_peft_adapter(
        owner.model,
        model_tmp,
        lora_cfg=getattr(getattr(cfg, "dtensor_cfg", None), "lora_cfg", None),
        base_model_name_or_path=getattr(cfg, "model_name", None),
        write=owner.parallel.rank == 0,
    )
    if owner.parallel.rank == 0:
        _write_json(model_tmp / MANIFEST_FILE, {**meta, "kind": "peft"})
    return []


def finalize_async_save(owner: CheckpointOwner, *, timeout_s: float = FINALIZE_TIMEOUT_S) -> None:
    """Block until every write of the last save landed and its folders are renamed into place."""
    owner.saver.finalize(owner.parallel, timeout_s=timeout_s)


def load_checkpoint(
    owner: CheckpointOwner,
    weights_path: str | os.PathLike[str],
    optimizer_path: str | os.PathLike[str] | None = None,
    *,
    verify_digests: bool = True,
) -> None:
    """Load weights (safetensors / DCP / PEFT, any layout), the saved reference, optimizer state.

    Collective. Validates and reads everything before changing the worker: a missing or
    truncated file raises `CheckpointError` naming it and leaves the worker as it was. Each
    folder's files are checked against the digests its save recorded; a folder a policyworker
    save wrote must have them. ``verify_digests=False`` skips those checks (a folder another
    tool rewrote on purpose).
    """
    load(owner, weights_path, optimizer_path, load_weights=True, verify_digests=verify_digests)


def load_checkpoint_at_init(
    owner: CheckpointOwner,
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
    load(owner, weights_path, optimizer_path, load_weights=not weights_loaded)

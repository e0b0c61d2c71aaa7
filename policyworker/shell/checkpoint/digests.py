"""Per-file digests of a checkpoint folder: written before the commit, verified before a load.

A flipped byte or an edited header in a shard otherwise loads silently. Each folder a save
commits (model/, optim/, reference/) gets `policyworker_digests.json` listing every other file
with its SHA-256 tree digest, and the digest of that list itself; a load checks every listed
file first and names the one that differs. A folder this library wrote (`written_by_us`) whose
digests file is missing, or lists fewer files than the folder holds, is an error: a flipped
bit in it would otherwise load unchecked. Folders of other tools (plain HF folders) load
unchecked, and `load_checkpoint(..., verify_digests=False)` skips the checks on purpose.

The digest of a file is SHA-256 over the SHA-256 digests of its 64 MiB pieces, so one large
shard is hashed by several threads (hashlib releases the GIL) and the cost stays a small part
of the save.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import mmap
import os
import pathlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from policyworker.shell.checkpoint.layout import (
    MANIFEST_FILE,
    MODEL_DIR,
    REFERENCE_DIR,
    CheckpointError,
)

__all__ = [
    "DIGESTS_FILE",
    "VERIFY_TIMEOUT_S",
    "DigestChecks",
    "verify_digests",
    "write_digests",
    "written_by_us",
]

DIGESTS_FILE = "policyworker_digests.json"
_PIECE_BYTES = 64 * 2**20
_ALGORITHM = "sha256-tree-64MiB"
# A cold 20 GB checkpoint hashes in well under a minute on a local disk; an hour means the
# storage has stalled (a hung network mount), not that it is slow.
VERIFY_TIMEOUT_S = 3600.0


def _piece_digest(path: pathlib.Path, offset: int) -> bytes:
    size = path.stat().st_size
    if size == 0:
        return hashlib.sha256(b"").digest()
    # Hash straight from the page cache (mmap): no copy of the piece into a Python buffer.
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return hashlib.sha256(view[offset : offset + _PIECE_BYTES]).digest()
        finally:
            view.release()


def _file_digests(folder: pathlib.Path, names: list[str]) -> dict[str, str]:
    jobs = [
        (name, offset)
        for name in names
        for offset in range(0, max((folder / name).stat().st_size, 1), _PIECE_BYTES)
    ]
    workers = max(1, min(len(jobs), os.cpu_count() or 1, 16))
    with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-digest") as pool:
        pieces = list(pool.map(lambda job: _piece_digest(folder / job[0], job[1]), jobs))
    per_file: dict[str, list[bytes]] = {name: [] for name in names}
    for (name, _), piece in zip(jobs, pieces, strict=True):
        per_file[name].append(piece)
    return {name: hashlib.sha256(b"".join(parts)).hexdigest() for name, parts in per_file.items()}


def _listed_files(folder: pathlib.Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(DIGESTS_FILE)
    )


def write_digests(folder: str | os.PathLike[str]) -> None:
    """Record the digest of every file under `folder` (called on the finished temporary folder)."""
    folder = pathlib.Path(folder)
    names = _listed_files(folder)
    digests = _file_digests(folder, names)
    files = {
        name: {"digest": digests[name], "bytes": (folder / name).stat().st_size} for name in names
    }
    body = {"algorithm": _ALGORITHM, "files": files, "files_digest": _list_digest(files)}
    # A fresh inode, never an in-place rewrite: an unchanged reference folder is hard-linked
    # from the previous checkpoint, and truncating a shared file would corrupt that one.
    staged = folder / f"{DIGESTS_FILE}.tmp"
    staged.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(staged, folder / DIGESTS_FILE)


def _list_digest(files: object) -> str:
    """SHA-256 of the file list itself: an edited entry then blames the digests file."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def written_by_us(folder: pathlib.Path) -> bool:
    """True for a folder a policyworker save wrote: a weights folder (manifest), the reference
    beside one, or a DCP optimizer folder with our keys ('extra', 'rng_rank<r>')."""
    if (folder / MANIFEST_FILE).is_file():
        return True
    if folder.name == REFERENCE_DIR and (folder.parent / MODEL_DIR / MANIFEST_FILE).is_file():
        return True
    if not (folder / ".metadata").is_file():
        return False
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        keys = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    except Exception:  # unreadable: the load's own check names the file
        return False
    return "extra" in keys and any(k.startswith("rng_rank") for k in keys)


_OPT_OUT = (
    "restore it from the save, or load the folder unchecked with "
    "load_checkpoint(..., verify_digests=False) if another tool rewrote it on purpose"
)


def _read_record(
    folder: pathlib.Path, record: pathlib.Path
) -> tuple[dict[str, str], dict[str, int]]:
    try:
        body = json.loads(record.read_text())
        expected = {str(k): str(v["digest"]) for k, v in body["files"].items()}
        sizes = {str(k): int(v["bytes"]) for k, v in body["files"].items()}
        algorithm = body["algorithm"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        msg = f"checkpoint file {str(record)!r} is unreadable ({exc}); it was edited -- {_OPT_OUT}"
        raise CheckpointError(msg) from exc
    if algorithm != _ALGORITHM:
        msg = f"checkpoint file {str(record)!r} uses digest {algorithm!r}; expected {_ALGORITHM}"
        raise CheckpointError(msg)
    if "files_digest" in body and body["files_digest"] != _list_digest(body["files"]):
        msg = (
            f"checkpoint file {str(record)!r} was edited: its entries no longer match the digest "
            f"the save recorded for them (the other files are not blamed) -- {_OPT_OUT}"
        )
        raise CheckpointError(msg)
    unlisted = sorted(set(_listed_files(folder)) - set(expected))
    if unlisted:
        msg = (
            f"checkpoint file {str(record)!r} has no digest entry for {unlisted} in "
            f"{str(folder)!r}: a save lists every file it wrote, so these were added or the "
            f"entries removed -- {_OPT_OUT}"
        )
        raise CheckpointError(msg)
    return expected, sizes


def verify_digests(folder: str | os.PathLike[str], *, required: bool | None = None) -> None:
    """Raise CheckpointError naming the first file whose bytes differ from the save's record.

    `required`: whether a missing digests file is an error; None decides by `written_by_us`.
    """
    folder = pathlib.Path(folder)
    record = folder / DIGESTS_FILE
    if not record.is_file():
        if required or (required is None and written_by_us(folder)):
            msg = (
                f"checkpoint file {str(record)!r} does not exist, but {str(folder)!r} was "
                f"written by a policyworker save, which always records the digests of its "
                f"files: without them a changed byte would load unchecked -- {_OPT_OUT}"
            )
            raise CheckpointError(msg)
        return
    expected, sizes = _read_record(folder, record)
    for name in sorted(expected):
        path = folder / name
        if not path.is_file():
            msg = (
                f"checkpoint file {str(path)!r} does not exist (the save listed it in "
                f"{DIGESTS_FILE}); the folder lost files -- load another checkpoint"
            )
            raise CheckpointError(msg)
        if path.stat().st_size != sizes[name]:
            msg = (
                f"checkpoint file {str(path)!r} is {path.stat().st_size} bytes but was saved "
                f"with {sizes[name]}; it is truncated or was rewritten -- load another "
                f"checkpoint"
            )
            raise CheckpointError(msg)
    actual = _file_digests(folder, sorted(expected))
    for name in sorted(expected):
        if actual[name] != expected[name]:
            msg = (
                f"checkpoint file {str(folder / name)!r} does not match the digest recorded "
                f"when it was saved: its bytes changed (disk or copy corruption, or an edit) "
                f"-- restore it or load another checkpoint"
            )
            raise CheckpointError(msg)


class DigestChecks:
    """`verify_digests` of several folders, running in background threads from construction
    (one per folder; each hashes with its own pool) while the caller reads the same files."""

    def __init__(self, folders: Sequence[pathlib.Path]) -> None:
        self._pool = ThreadPoolExecutor(
            max(1, len(folders)), thread_name_prefix="checkpoint-verify"
        )
        self._checks = [(f, self._pool.submit(verify_digests, f)) for f in folders]

    def wait(self, *, timeout_s: float = VERIFY_TIMEOUT_S) -> None:
        """Block until every check finished; raise the first failure in folder order.

        Raises:
            CheckpointError: a file's bytes, size or presence differ from the save's record.
            TimeoutError: the checks did not finish within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        try:
            for folder, check in self._checks:
                try:
                    check.result(timeout=max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    msg = (
                        f"checking the digests of checkpoint folder {str(folder)!r} did not "
                        f"finish within {timeout_s} s; the storage is stalled or too slow"
                    )
                    raise TimeoutError(msg) from None
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

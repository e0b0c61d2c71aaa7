"""Per-file digests of a checkpoint folder: written before the commit, verified before a load.

A flipped byte or an edited header in a shard otherwise loads silently. Each folder a save
commits (model/, optim/, reference/) gets `policyworker_digests.json` listing every other file
with its SHA-256 tree digest, and the digest of that list itself; a load checks every listed
file first and names the one that differs. A folder this library wrote (`written_by_us`) whose
digests file is missing, or lists fewer files than the folder holds, is an error: a flipped
bit in it would otherwise load unchecked. Folders of other tools (plain HF folders) load
unchecked, and `load_checkpoint(..., verify_digests=False)` skips the checks on purpose.

The digest of a file is a tree: the hash of the concatenated hashes of its 64 MiB pieces, so
one large shard is hashed by several threads (both hashes release the GIL). A save hashes most
of its bytes while it writes them: the writer threads feed each piece they write to a hasher
(`TreeHasher`; the HF weights writer and DCP's streams through `hashing_io`) and note the
file's digest with its identity (`record_written`: inode, size, mtime); `write_digests_of` takes
a noted digest while the file still has that identity and reads back only the others (JSON
files, a weights file written by several ranks). The digests are the same bytes either way,
and a load reads every file back to verify it, as before. A save uses BLAKE3 where the `blake3`
package is installed (it comes with vLLM; about 3x SHA-256's speed per core), else SHA-256; the
digests file names the algorithm, and a load verifies either, so folders saved before BLAKE3
was used still verify.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import json
import mmap
import os
import pathlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

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
    "TreeHasher",
    "record_written",
    "save_algorithm",
    "verify_digests",
    "write_digests",
    "written_by_us",
]

DIGESTS_FILE = "policyworker_digests.json"
_PIECE_BYTES = 64 * 2**20
# The writers hash what they write (read at each save; bench/ turns it off to time the second
# pass over the written files that it replaces).
HASH_WHILE_WRITING = True
_SHA256 = "sha256-tree-64MiB"
_BLAKE3 = "blake3-tree-64MiB"
# A cold 20 GB checkpoint hashes in well under a minute on a local disk; an hour means the
# storage has stalled (a hung network mount), not that it is slow.
VERIFY_TIMEOUT_S = 3600.0


def _hash_function(algorithm: str) -> Callable[..., Any]:
    """The hash object constructor `algorithm` names; CheckpointError when it is not available."""
    if algorithm == _SHA256:
        return hashlib.sha256
    if algorithm == _BLAKE3:
        try:
            import blake3
        except ImportError:
            msg = (
                f"the checkpoint's digests use {_BLAKE3}, which needs the 'blake3' package "
                f"(pip install blake3; vLLM installs it) -- or load it unchecked with "
                f"load_checkpoint(..., verify_digests=False)"
            )
            raise CheckpointError(msg) from None
        return cast("Callable[..., Any]", blake3.blake3)
    msg = f"unknown checkpoint digest algorithm {algorithm!r}; expected {_SHA256} or {_BLAKE3}"
    raise CheckpointError(msg)


def save_algorithm() -> str:
    """The algorithm a save records: BLAKE3 where installed, else SHA-256."""
    return _BLAKE3 if importlib.util.find_spec("blake3") is not None else _SHA256


class TreeHasher:
    """A file's tree digest (`write_digests`' own), fed its bytes in order as they are written,
    or one piece at a time (``piece``/``add_piece``: pieces hashed by several threads)."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm, self.piece_bytes = algorithm, _PIECE_BYTES
        self._new = _hash_function(algorithm)
        self._pieces: list[bytes] = []
        self._current = self._new()
        self._filled = 0  # bytes of the current piece hashed so far
        self.size = 0

    def update(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            take = min(len(data), self.piece_bytes - self._filled)
            self._current.update(data[:take])
            self._filled += take
            self.size += take
            data = data[take:]
            if self._filled == self.piece_bytes:
                self._pieces.append(bytes(self._current.digest()))
                self._current, self._filled = self._new(), 0

    def piece(self) -> Any:
        """A fresh hash object for one whole piece (``add_piece`` takes its digest)."""
        return self._new()

    def hexdigest(self, pieces: Sequence[bytes] | None = None) -> str:
        """The tree digest of what was fed (or of ``pieces``, every piece's digest in order)."""
        if pieces is None:
            pieces = list(self._pieces)
            if self._filled or not pieces:  # an empty file is one empty piece
                pieces.append(bytes(self._current.digest()))
        return str(self._new(b"".join(pieces)).hexdigest())


# Digests the writers computed, by absolute path: (inode, size, mtime_ns), (algorithm, piece
# size), digest. Bounded: entries a failed save never collects are dropped past the cap.
_WRITTEN: dict[str, tuple[tuple[int, int, int], tuple[str, int], str]] = {}
_WRITTEN_LOCK = threading.Lock()
_WRITTEN_MAX = 1 << 16


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def record_written(
    path: str | os.PathLike[str], digest: str, *, hasher: TreeHasher, size: int
) -> None:
    """Note the `digest` (of `hasher`'s kind) of a file a save just wrote and closed, made from
    its `size` bytes as they were written (not noted when the file holds another count)."""
    identity = _identity(path)
    if identity[1] != size:
        return
    with _WRITTEN_LOCK:
        if len(_WRITTEN) >= _WRITTEN_MAX:
            _WRITTEN.clear()
        kind = (hasher.algorithm, hasher.piece_bytes)
        _WRITTEN[os.path.abspath(path)] = (identity, kind, digest)


def _take_written(path: pathlib.Path, algorithm: str) -> str | None:
    """The noted digest of `path`, if it is of `algorithm` (and today's piece size) and the file
    is still the one hashed (same inode, size and modification time); forgotten either way."""
    with _WRITTEN_LOCK:
        entry = _WRITTEN.pop(os.path.abspath(path), None)
    if entry is None or entry[1] != (algorithm, _PIECE_BYTES):
        return None
    try:
        return entry[2] if _identity(path) == entry[0] else None
    except OSError:
        return None


def _piece_digest(path: pathlib.Path, offset: int, new_hash: Callable[..., Any]) -> bytes:
    size = path.stat().st_size
    if size == 0:
        return bytes(new_hash(b"").digest())
    # Hash straight from the page cache (mmap): no copy of the piece into a Python buffer.
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return bytes(new_hash(view[offset : offset + _PIECE_BYTES]).digest())
        finally:
            view.release()


def _digests_of(paths: list[pathlib.Path], algorithm: str) -> list[str]:
    """The tree digest of each file, every piece of every file hashed in one thread pool (the
    folders of one save share it, so a folder of few files does not leave threads idle)."""
    new_hash = _hash_function(algorithm)
    jobs = [
        (i, offset)
        for i, path in enumerate(paths)
        for offset in range(0, max(path.stat().st_size, 1), _PIECE_BYTES)
    ]
    workers = max(1, min(len(jobs), os.cpu_count() or 1, 16))
    with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-digest") as pool:
        pieces = list(pool.map(lambda job: _piece_digest(paths[job[0]], job[1], new_hash), jobs))
    per_file: list[list[bytes]] = [[] for _ in paths]
    for (i, _), piece in zip(jobs, pieces, strict=True):
        per_file[i].append(piece)
    return [str(new_hash(b"".join(parts)).hexdigest()) for parts in per_file]


def _file_digests(folder: pathlib.Path, names: list[str], algorithm: str) -> dict[str, str]:
    return dict(zip(names, _digests_of([folder / n for n in names], algorithm), strict=True))


def _listed_files(folder: pathlib.Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(DIGESTS_FILE)
    )


def write_digests(folder: str | os.PathLike[str], *, algorithm: str | None = None) -> None:
    """Record the digest of every file under `folder` (called on the finished temporary folder).

    `algorithm` (default `save_algorithm()`): "blake3-tree-64MiB" or "sha256-tree-64MiB".
    """
    write_digests_of([folder], algorithm=algorithm)


def write_digests_of(
    folders: Sequence[str | os.PathLike[str]], *, algorithm: str | None = None
) -> None:
    """`write_digests` of several folders, their files hashed together in one thread pool."""
    algorithm = save_algorithm() if algorithm is None else algorithm
    paths = [pathlib.Path(f) for f in folders]
    names = [_listed_files(folder) for folder in paths]
    flat = [folder / n for folder, ns in zip(paths, names, strict=True) for n in ns]
    written = [_take_written(path, algorithm) for path in flat]
    unhashed = [path for path, digest in zip(flat, written, strict=True) if digest is None]
    read_back = iter(_digests_of(unhashed, algorithm))  # what the writers did not hash
    digests = iter([next(read_back) if d is None else d for d in written])
    for folder, folder_names in zip(paths, names, strict=True):
        files = {
            name: {"digest": next(digests), "bytes": (folder / name).stat().st_size}
            for name in folder_names
        }
        body = {"algorithm": algorithm, "files": files, "files_digest": _list_digest(files)}
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
) -> tuple[dict[str, str], dict[str, int], str]:
    try:
        body = json.loads(record.read_text())
        expected = {str(k): str(v["digest"]) for k, v in body["files"].items()}
        sizes = {str(k): int(v["bytes"]) for k, v in body["files"].items()}
        algorithm = body["algorithm"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        msg = f"checkpoint file {str(record)!r} is unreadable ({exc}); it was edited -- {_OPT_OUT}"
        raise CheckpointError(msg) from exc
    if algorithm not in (_SHA256, _BLAKE3):
        msg = (
            f"checkpoint file {str(record)!r} uses digest {algorithm!r}; expected {_SHA256} "
            f"or {_BLAKE3}"
        )
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
    return expected, sizes, str(algorithm)


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
    expected, sizes, algorithm = _read_record(folder, record)
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
    actual = _file_digests(folder, sorted(expected), algorithm)
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

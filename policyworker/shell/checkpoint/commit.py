"""The atomic commit of a checkpoint: fsync, a commit record, renames, and recovery.

A save becomes visible only through a commit record naming all of its temporary folders, so
weights and optimizer always come from one save; a crash after the record is rolled forward by
the next load or save (`recover_checkpoint_commits`). Also the rank-0-runs, everyone-agrees
helpers the save and load steps share.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import pathlib
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from policyworker.shell.checkpoint.claims import claim_path, remove_unclaimed
from policyworker.shell.checkpoint.layout import FORMAT_VERSION, CheckpointError

__all__ = ["COMMIT_RECORD_PREFIX", "LOCK_TIMEOUT_S", "recover_checkpoint_commits"]

LOCK_TIMEOUT_S = 600.0
COMMIT_RECORD_PREFIX = "policyworker_commit-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


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
        body = read_json(record)
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
    for tmp, final, _ in body["pairs"]:
        shutil.rmtree(_old_for(final, token), ignore_errors=True)
        claim_path(tmp).unlink(missing_ok=True)  # the folder it claimed is committed
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
    """Remove `<final>.tmp-*` folders no live process claims (saves that died before their
    commit record: never committed) and `<final>.old-*` copies a finished commit replaced.
    Run after recovery, under the parent folder's lock."""
    if not final.parent.is_dir():
        return
    remove_unclaimed(final.parent, f"{final.name}.tmp-")
    for p in final.parent.iterdir():
        if p.name.startswith(f"{final.name}.old-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _on_rank0(parallel: Any, what: str, fn: Callable[[], object]) -> None:
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


def _write_json(path: pathlib.Path, obj: Any) -> None:
    # A fresh inode (write, then rename): files of an unchanged reference folder are hard links
    # into the previous checkpoint, which an in-place rewrite would change too.
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(staged, path)


def read_json(path: pathlib.Path) -> Any:
    """A checkpoint JSON file's content; CheckpointError naming the file when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        msg = (
            f"checkpoint file {str(path)!r} is not valid JSON ({exc}); it was edited or "
            f"written in part -- restore it from the save or load another checkpoint"
        )
        raise CheckpointError(msg) from exc


def _commit(commits: Sequence[tuple[pathlib.Path, pathlib.Path]]) -> None:
    """Digest and fsync every temporary folder, write the commit records, then rename into
    place."""
    from policyworker.shell.checkpoint.digests import write_digests

    for tmp, _ in commits:
        write_digests(tmp)
        _fsync_tree(tmp)
    token = commits[0][0].name.rsplit(".tmp-", 1)[1]
    with _locked([final.parent for _, final in commits]):
        records = _write_commit_records(token, commits)
        _apply_record(records[0])


def _all_ranks_max(parallel: Any, value: int) -> int:
    if parallel.world_size == 1:
        return value
    return parallel.all_reduce_int(value, op="max", axis="world")


def _shared_token(parallel: Any) -> str:
    """A random hex token equal on every rank (from the OS, so no RNG state is consumed)."""
    value = secrets.randbits(48) if parallel.rank == 0 else 0
    if parallel.world_size > 1:
        value = parallel.all_reduce_int(value, op="sum", axis="world")
    return f"{value:012x}"


def _tmp_for(final: pathlib.Path, token: str) -> pathlib.Path:
    return final.with_name(f"{final.name}.tmp-{token}")

"""Which process owns a staged folder: a claim file beside each `<final>.tmp-<token>` folder.

Several processes may save under one root at once (two runs, two workers of one job sharing a
folder). Each save stages into folders named by its own random token, and the process that
created them holds an exclusive `flock` on `<final>.tmp-<token>.lock` until the folder is
committed or removed. A save clears only the staged folders whose claim no live process holds:
the kernel drops the lock when its holder exits or is killed, so what a dead save left is
removed by the next one, and a live save's folders are never touched. Where the filesystem has
no `flock`, the claim file's host and pid decide (a process on another host counts as live).

Claims are made and checked under the parent folder's lock (`commit._locked`), so no save sees
a folder between its creation and its claim.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import socket

__all__ = ["claim_folder", "is_claimed", "release_claim", "remove_unclaimed"]

CLAIM_SUFFIX = ".lock"


def claim_path(tmp: pathlib.Path) -> pathlib.Path:
    """The claim file of staged folder `tmp` (beside it, so the checkpoint holds no extra file)."""
    return tmp.with_name(tmp.name + CLAIM_SUFFIX)


def claim_folder(tmp: pathlib.Path) -> int:
    """Create the staged folder `tmp` and claim it; returns the descriptor that holds the claim.

    Call under the parent folder's lock. Keep the descriptor open until `release_claim`.
    """
    fd = os.open(claim_path(tmp), os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    try:
        with contextlib.suppress(OSError):  # no flock on this filesystem: the pid is the claim
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        tmp.mkdir(parents=True, exist_ok=False)
    except BaseException:
        os.close(fd)
        claim_path(tmp).unlink(missing_ok=True)
        raise
    return fd


def release_claim(tmp: pathlib.Path, fd: int) -> None:
    """Drop the claim on `tmp` (after it was committed or removed)."""
    claim_path(tmp).unlink(missing_ok=True)
    os.close(fd)


def is_claimed(tmp: pathlib.Path) -> bool:
    """True while a live process (this one included) holds the claim of staged folder `tmp`."""
    claim = claim_path(tmp)
    try:
        fd = os.open(claim, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
    except BlockingIOError:
        return True
    except OSError:  # no flock here: the claimant's pid decides
        return _claimant_alive(claim)
    finally:
        os.close(fd)
    return False


def _claimant_alive(claim: pathlib.Path) -> bool:
    try:
        host, pid = claim.read_text().split()
        if host != socket.gethostname():
            return True  # cannot tell from here: leave it
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True
    return True


def remove_unclaimed(parent: pathlib.Path, prefix: str) -> None:
    """Remove the folders `<prefix>*` in `parent` (and claim files) that no live process claims.

    Call under `parent`'s lock.
    """
    if not parent.is_dir():
        return
    for p in sorted(parent.iterdir()):
        if not p.name.startswith(prefix):
            continue
        if p.is_dir():
            if not is_claimed(p):
                shutil.rmtree(p, ignore_errors=True)
                claim_path(p).unlink(missing_ok=True)
            continue
        folder = p.with_name(p.name.removesuffix(CLAIM_SUFFIX))
        if p.name.endswith(CLAIM_SUFFIX) and not folder.exists() and not is_claimed(folder):
            p.unlink(missing_ok=True)  # the claim of a folder removed above or by hand

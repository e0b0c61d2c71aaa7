"""The operating-system side of a colocated ZMQ refit: socket folders, staging files, limits.

A sender binds its DEALER socket in a fresh private (0700) ``pw-refit-*`` folder in the temp folder
and stages CPU buckets in fresh 0600 ``pw-refit-*`` files in ``SHM_DIR``. Each entry carries a
shared ``flock`` for as long as its sender lives, so ``remove_orphans`` (run by every new
sender) removes exactly what dead senders left. Also here: the Unix socket path limit, ZMQ's
millisecond timeouts, and reserving a staging file's pages up front (a full tmpfs then raises
``StagingSpaceError`` instead of killing the process with SIGBUS).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
from typing import Any

import zmq

from policyworker.errors import RefitError

__all__ = [
    "IPC_PATH_MAX_BYTES",
    "SHM_DIR",
    "StagingSpaceError",
    "ZmqHandles",
    "check_ipc_address",
    "close_monitored_socket",
    "create_locked_dir",
    "create_locked_file",
    "remove_orphans",
    "reserve_pages",
    "shm_free_bytes",
    "zmq_timeout_ms",
]

# Where CPU staging files live; both sides of a refit must see the same folder (the receiver
# opens a buffer by name there). POLICYWORKER_SHM_DIR overrides it (tests use a small tmpfs).
SHM_DIR = os.environ.get("POLICYWORKER_SHM_DIR") or (
    "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
)
_PREFIX = "pw-refit-"  # staging files and socket folders; orphans of dead senders are removed
IPC_PATH_MAX_BYTES = 107  # sockaddr_un.sun_path holds 108 bytes, one of them the final NUL
_MAX_TIMEOUT_MS = (1 << 31) - 1  # ZMQ's timeouts are C ints of milliseconds


class StagingSpaceError(RefitError):
    """The shared-memory folder cannot hold a staging buffer (a small container /dev/shm)."""


def zmq_timeout_ms(timeout_s: float) -> int:
    """A ZMQ timeout in milliseconds: at least 1, at most what a C int holds."""
    return max(1, min(_MAX_TIMEOUT_MS, int(min(timeout_s, _MAX_TIMEOUT_MS / 1000) * 1000)))


def check_ipc_address(address: str, *, fix: str) -> None:
    """``ValueError`` when an ``ipc://`` address's path is too long for a Unix socket, so a
    constructor fails at once instead of the first refit."""
    if not address.startswith("ipc://"):
        return
    size = len(os.fsencode(address[len("ipc://") :]))
    if size > IPC_PATH_MAX_BYTES:
        msg = (
            f"address {address!r}: its socket path is {size} bytes, but a Unix socket path "
            f"holds at most {IPC_PATH_MAX_BYTES}; {fix}"
        )
        raise ValueError(msg)


def close_monitored_socket(socket: zmq.Socket[Any] | None, monitor: zmq.Socket[Any] | None) -> None:
    """Close a socket and its connection-event monitor at once (the monitor first: it is
    attached to the socket), dropping unsent messages."""
    if monitor is not None:
        assert socket is not None
        socket.disable_monitor()
        monitor.close(linger=0)
    if socket is not None:
        socket.close(linger=0)


class ZmqHandles:
    """A ZMQ context, the socket made from it and the socket's connection monitor, and (a
    sender's) private socket folder with its lock: ``release()`` frees them in the one order that
    cannot block (the sockets, then the context), then the folder.

    Owners register ``release`` with ``weakref.finalize``. An owner dropped without ``close()``
    and held in a reference cycle (a caught exception's traceback makes one) is otherwise left to
    the garbage collector, which clears weak references first: pyzmq's ``Context.__del__`` then
    finds no sockets to close and blocks for good in ``term()``. The finalizer holds this object,
    so the context stays out of that collection until the sockets are closed. (Not at exit,
    where a daemon thread may still be using a socket: the OS frees them then, and the next
    sender removes the folder as an orphan.)
    """

    def __init__(self, folder: str | None = None, folder_fd: int = -1) -> None:
        self.context: zmq.Context[Any] | None = zmq.Context()
        self.socket: zmq.Socket[Any] | None = None
        self.monitor: zmq.Socket[Any] | None = None  # the socket's connection events
        self.folder = folder
        self.folder_fd = folder_fd

    def close_socket(self) -> None:
        close_monitored_socket(self.socket, self.monitor)
        self.socket = self.monitor = None

    def release(self) -> None:
        """Close the socket and monitor, then the context, then remove the folder (idempotent)."""
        self.close_socket()
        if self.context is not None:
            self.context.term()
            self.context = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        if self.folder_fd >= 0:
            os.close(self.folder_fd)
            self.folder_fd = -1


def _locked_entry(path: str, fd: int) -> bool:
    """After taking a shared lock on ``fd``: does ``path`` still name it? (A cleaner in another
    process may have removed a fresh, not yet locked entry; the caller then makes a new one.)"""
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def create_locked_file(folder: str) -> tuple[str, str, int]:
    """A fresh 0600 ``pw-refit-*`` file in ``folder``: (name, path, fd holding a shared lock).

    The lock lives as long as the fd: while it is held, ``remove_orphans`` leaves the file alone;
    once the process dies (even by SIGKILL) the kernel drops it and the next sender removes it."""
    for _ in range(8):
        name = f"{_PREFIX}{secrets.token_hex(12)}"
        path = os.path.join(folder, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if _locked_entry(path, fd):
            return name, path, fd
        os.close(fd)
    msg = f"could not create a staging file in {folder}: it was removed 8 times in a row"
    raise RefitError(msg)


def create_locked_dir() -> tuple[str, int]:
    """A fresh 0700 ``pw-refit-*`` folder for the socket: (path, fd holding a shared lock)."""
    for _ in range(8):
        folder = tempfile.mkdtemp(prefix=_PREFIX)  # mode 0700: only this user can connect
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        if _locked_entry(folder, fd):
            return folder, fd
        os.close(fd)
    raise RefitError(f"could not create a socket folder in {tempfile.gettempdir()}")


def remove_orphans() -> int:
    """Remove the staging files (in ``SHM_DIR``) and socket folders (in the temp folder) of
    this user's senders that died without closing; the number removed.

    A live sender holds a lock on each of its entries, so only unlocked ones go (an exclusive
    lock taken without waiting proves no process holds it; it also works across PID namespaces
    sharing the folder)."""
    removed = 0
    for folder in dict.fromkeys((SHM_DIR, tempfile.gettempdir())):
        try:
            names = [n for n in os.listdir(folder) if n.startswith(_PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
                is_dir = stat.S_ISDIR(info.st_mode)
                if info.st_uid != os.getuid() or not (is_dir or stat.S_ISREG(info.st_mode)):
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if is_dir else 0))
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino != info.st_ino:
                    continue
                if is_dir:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
                removed += 1
            except OSError:
                continue  # locked: its sender is alive
            finally:
                os.close(fd)
    return removed


def shm_free_bytes() -> int | None:
    """Bytes free in ``SHM_DIR`` (None when unknown): the CPU default staging size stays well
    within it, so a small container /dev/shm gets smaller buckets instead of an error."""
    try:
        info = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def reserve_pages(fd: int, nbytes: int, path: str) -> None:
    """Allocate the file's pages now: a sparse shared mapping on a full tmpfs kills the process
    with SIGBUS at the first write instead of raising."""
    try:
        if not hasattr(os, "posix_fallocate"):  # not Linux: a sparse file, as before
            os.ftruncate(fd, nbytes)
            return
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a folder that cannot reserve
            os.ftruncate(fd, nbytes)
            return
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
            raise
        try:
            info = os.statvfs(os.path.dirname(path))
            free = f"{info.f_bavail * info.f_frsize / 2**20:.1f} MiB are free"
        except OSError:
            free = "its free space is unknown"
        msg = (
            f"refit staging needs {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of shared memory in "
            f"{os.path.dirname(path)}, but {free} ({os.strerror(exc.errno)}). Give the trainer's "
            "container more shared memory (docker run --shm-size=2g, or a Kubernetes emptyDir "
            "with medium: Memory at /dev/shm), or pass a smaller buffer_size_bytes to "
            "stream_weights_via_ipc_zmq (a tensor larger than a buffer still needs its own size)"
        )
        raise StagingSpaceError(msg) from None

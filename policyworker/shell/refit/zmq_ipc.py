"""Colocated refit over ZMQ: ping-pong staging buffers shared by CUDA IPC or POSIX shared memory.

Sender (``ZmqIpcSender``, a REQ socket bound in a private 0700 folder) and receiver
(``ZmqIpcReceiver``, a REP socket, driving a ``RefitServer``) speak the protocol of
docs/refit-protocol.md through ``wire.py``: BEGIN (manifest) → BUCKET* → COMPLETE, each answered
by one reply; a rejection or an ABORT ends the refit on both sides at once. Buffers: CUDA tensors
shared by their ``_share_cuda_()`` handle, or files in /dev/shm mapped with ``torch.from_file``
on CPU — the same protocol code either way, so CPU tests cover it.

Per-refit host work is kept small: the sender caches the encoded manifest per specs object and,
per staging buffer, each bucket's typed slot views and encoded frames; with ``keep_staging`` the
two ping-pong buffers survive the refit (and so do those caches). The receiver keeps its last
manifest parse, opens each buffer once while the sender keeps it, and caches each bucket's
source views and destinations, so a bucket costs one JSON parse, one check loop and one grouped
copy launch.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import attrs
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import (
    DEFAULT_ALIGNMENT,
    IpcBucket,
    SplitLayout,
    TensorSpec,
    split_layout,
    split_views,
    unpack_tensors,
)
from policyworker.shell.refit.params import RefitSource
from policyworker.shell.refit.wire import (
    Abort,
    Begin,
    Bucket,
    Complete,
    CudaBuffer,
    ManifestCache,
    ProtocolError,
    RefitRejectedError,
    Reply,
    ShmBuffer,
    check_bucket,
    decode_reply,
    decode_request,
    encode,
    encode_manifest,
)

__all__ = [
    "IPC_PATH_MAX_BYTES",
    "SHM_DIR",
    "ReceiverClosedError",
    "StagingSpaceError",
    "check_ipc_address",
    "remove_orphans",
    "shm_free_bytes",
    "LARGE_COPY_NUMEL",
    "copy_groups",
    "grouped_copy_",
    "run_copy_groups",
    "CudaStaging",
    "ReceivedBuffers",
    "RefitServer",
    "ShmStaging",
    "WeightSink",
    "ZmqIpcReceiver",
    "ZmqIpcSender",
]

log = logging.getLogger(__name__)
# Where CPU staging files live; both sides of a refit must see the same folder (the receiver
# opens a buffer by name there). POLICYWORKER_SHM_DIR overrides it (tests use a small tmpfs).
SHM_DIR = os.environ.get("POLICYWORKER_SHM_DIR") or (
    "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
)
_ABORT_TIMEOUT_S = 2.0
_PREFIX = "pw-refit-"  # staging files and socket folders; orphans of dead senders are removed
IPC_PATH_MAX_BYTES = 107  # sockaddr_un.sun_path holds 108 bytes, one of them the final NUL
_MAX_TIMEOUT_MS = (1 << 31) - 1  # ZMQ's timeouts are C ints of milliseconds
_POLL_SLICE_MS = 50  # a waiting receive() notices close() from another thread this fast
_CLOSE_WAIT_S = 2.0  # how long close() waits for a receive() in another thread to let go
_MAX_REPLY_BYTES = 4 << 20  # a reply is a small header (+ an event handle): bound what we read


class StagingSpaceError(RefitError):
    """The shared-memory folder cannot hold a staging buffer (a small container /dev/shm)."""


class ReceiverClosedError(RefitError):
    """``close()`` was called (maybe from another thread) while ``receive()`` waited."""


def _ms(timeout_s: float) -> int:
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


def _locked_entry(path: str, fd: int) -> bool:
    """After taking a shared lock on ``fd``: does ``path`` still name it? (A cleaner in another
    process may have removed a fresh, not yet locked entry; the caller then makes a new one.)"""
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _create_locked_file(folder: str) -> tuple[str, str, int]:
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


def _create_locked_dir() -> tuple[str, int]:
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


def _reserve(fd: int, nbytes: int, path: str) -> None:
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


# ----------------------------------------------------------------------------- staging (sender)


class ShmStaging:
    """A uint8 staging buffer in a fresh 0600 file under /dev/shm, mapped shared.

    ``cache`` holds per-bucket slot views and encoded frames (see ``ZmqIpcSender.stream``);
    ``close`` drops it with the mapping.
    """

    def __init__(self, nbytes: int) -> None:
        self.name, self.path, self._fd = _create_locked_file(SHM_DIR)
        try:
            _reserve(self._fd, max(nbytes, 1), self.path)
            self.tensor: torch.Tensor | None = torch.from_file(
                self.path, shared=True, size=max(nbytes, 1), dtype=torch.uint8
            )
        except BaseException:
            os.unlink(self.path)
            os.close(self._fd)
            raise
        self.size = nbytes
        self.base = 0  # where this buffer starts in the shared file (a half starts further in)
        self._file_size = nbytes
        self._owners = [self]  # the objects sharing the file; the last one to close unlinks it
        self.cache: dict[Any, Any] = {}

    def halves(self, nbytes: int) -> tuple[ShmStaging, ShmStaging]:
        """Two buffers of ``nbytes`` over this one's file (which must hold both); consumes self.
        The file is unlinked when both are closed."""
        first, second = _split(self, nbytes)
        self._owners[:] = [first, second]
        return first, second

    def ref(self, *, keep: bool = False) -> ShmBuffer:
        return ShmBuffer(self.name, self._file_size, keep)

    def intact(self) -> bool:
        """The file is still ours, linked under its name, at its full size (a kept buffer that
        someone truncated would SIGBUS the first write into its mapping)."""
        try:
            mine, named = os.fstat(self._fd), os.stat(self.path)
        except OSError:
            return False
        return named.st_ino == mine.st_ino and mine.st_size >= max(self._file_size, 1)

    # Writes through a shared mapping are visible to the peer at once, and the receiver copies
    # synchronously before its ACK: the ordering hooks of CudaStaging have nothing to do here.
    def wait_for_reader(self) -> None:
        pass

    def mark_filled(self) -> None:
        pass

    def note_consumed(self, handle: bytes) -> None:
        pass

    def forget_consumed(self) -> None:
        pass

    def close(self) -> None:
        self.cache.clear()
        self.tensor = None
        if self in self._owners:
            self._owners.remove(self)
            if not self._owners:  # the last view of the file: remove it, then drop our lock
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                os.close(self._fd)


class CudaStaging:
    """A uint8 CUDA staging buffer, shared by the handle of its whole storage (computed once).

    Ordering between the two processes stays on the GPU: the sender records ``filled`` (an
    interprocess event) after queueing the casts into the buffer, the receiver's stream waits on
    it before reading, and the receiver's ACK carries its own event, which the sender's stream
    waits on before writing the buffer again. Neither side blocks its CPU on the GPU per bucket.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.tensor: torch.Tensor | None = torch.empty(
            max(nbytes, 1), dtype=torch.uint8, device=device
        )
        self.size = nbytes
        self.base = (
            0  # where this buffer starts in its shared allocation (a half starts further in)
        )
        self.cache: dict[Any, Any] = {}
        self._ref: CudaBuffer | None = None
        self.filled = torch.cuda.Event(interprocess=True)
        self._consumed: torch.cuda.Event | None = None
        self._consumed_handle = b""

    def halves(self, nbytes: int) -> tuple[CudaStaging, CudaStaging]:
        """Two buffers of ``nbytes`` over this one's allocation (one IPC handle, one mapping on the
        receiver, each half with its own filled event); consumes self."""
        whole = self.ref()  # the handle of the whole allocation, computed once and shared
        pair = _split(self, nbytes)
        for half in pair:
            half.filled = torch.cuda.Event(interprocess=True)
            half._ref = attrs.evolve(whole, filled_event=bytes(half.filled.ipc_handle()))
        return pair

    def ref(self, *, keep: bool = False) -> CudaBuffer:
        if self._ref is None:
            assert self.tensor is not None
            (_, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync) = (
                self.tensor.untyped_storage()._share_cuda_()
            )
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            self._ref = CudaBuffer(
                uuid,
                int(size),
                int(offset),
                int(rc_offset),
                bool(event_sync),
                bytes(handle),
                bytes(rc_handle),
                bytes(event_handle or b""),
                bytes(self.filled.ipc_handle()),
            )
        return attrs.evolve(self._ref, keep=keep)

    def wait_for_reader(self) -> None:
        """Queue (on the current stream) a wait for the receiver's reads.

        Waits for the reads of this buffer's last bucket, before writing or freeing it.
        """
        if self._consumed is not None:
            torch.cuda.current_stream(self.device).wait_event(self._consumed)

    def mark_filled(self) -> None:
        """Record that the casts into this buffer are queued on the current stream.

        The receiver waits on this.
        """
        self.filled.record(torch.cuda.current_stream(self.device))

    def note_consumed(self, handle: bytes) -> None:
        """Remember the receiver's event from the ACK of this buffer's bucket.

        The event is opened once per handle.
        """
        if not handle:
            msg = (
                "the receiver's ACK of a CUDA bucket carries no consumed-event handle "
                "(protocol mismatch)"
            )
            raise ProtocolError(msg)
        if handle != self._consumed_handle:
            self._consumed = _open_event(self.device, handle)
            self._consumed_handle = handle

    def forget_consumed(self) -> None:
        """After a complete refit every read is done (the receiver synchronised before COMPLETE)."""
        self._consumed, self._consumed_handle = None, b""

    def intact(self) -> bool:
        return self.tensor is not None

    def close(self) -> None:
        self.cache.clear()
        self.tensor = None
        self._consumed = None


Staging = ShmStaging | CudaStaging


def _split(whole: Any, nbytes: int) -> tuple[Any, Any]:
    """Shallow copies of ``whole`` viewing its bytes at bases 0 and ``nbytes`` (the classes'
    ``halves`` add what each kind needs); ``whole`` gives up its view.

    One allocation for the ping-pong pair halves the per-refit allocations, IPC handles and
    receiver mappings of a refit that frees its staging (opening a mapping costs ~0.5 ms).
    """
    assert whole.tensor is not None and whole.size >= 2 * nbytes and not whole.cache
    halves = []
    for base in (0, nbytes):
        half = copy.copy(whole)
        half.tensor, half.size, half.base, half.cache = (
            whole.tensor[base : base + nbytes],
            nbytes,
            base,
            {},
        )
        halves.append(half)
    whole.tensor = None
    return halves[0], halves[1]


def _slots(staging: Staging, bucket: IpcBucket, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Typed views of each tensor's slot in the staging bytes."""
    assert staging.tensor is not None
    buf = staging.tensor
    out = []
    for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
        spec = specs[index]
        out.append(buf[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape))
    return out


# At and above this many elements a plain ``copy_`` beats the multi-tensor kernel (H200, 7B
# shapes: a bf16 copy of the large matrices ran 11.0 ms grouped vs 8.1 ms one by one, while for
# the many small tensors of a 1.5B model grouping won, 2.6 vs 3.4 ms: launches dominate there).
LARGE_COPY_NUMEL = 1 << 22


def grouped_copy_(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, non_blocking: bool = False
) -> None:
    """``dsts[k].copy_(srcs[k])`` for every k (casting): large pairs one by one, the rest in as
    few ``_foreach_copy_`` calls as CUDA's multi-tensor fast route allows (see ``copy_groups``)."""
    run_copy_groups(copy_groups(dsts, srcs), non_blocking=non_blocking)


def run_copy_groups(
    groups: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]], *, non_blocking: bool = False
) -> None:
    """Launch the copies of ``copy_groups``: a single pair as ``copy_``, a group as one
    ``_foreach_copy_``."""
    for dsts, srcs in groups:
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0], non_blocking=non_blocking)
        else:
            # torch's grouped copy kernel; public API, just missing from torch's export list
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)  # pyright: ignore[reportPrivateImportUsage]


def _open_event(device: torch.device, handle: bytes) -> torch.cuda.Event:
    """The interprocess CUDA event behind ``handle``, opened on ``device``."""
    # Event.from_ipc_handle builds an instance of the class it is called on (a torch.cuda.Event);
    # torch's stubs type it as the C base class, so say what it is.
    return cast(torch.cuda.Event, torch.cuda.Event.from_ipc_handle(device, handle))


def copy_groups(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The ``(destinations, sources)`` lists ``grouped_copy_`` launches, in first-seen order:
    each pair of ``LARGE_COPY_NUMEL`` elements or more alone; the others one group per
    (destination dtype, source dtype) among pairs that are both contiguous, plus one for the rest
    (a mixed list would send the whole call down the one-launch-per-tensor path)."""
    groups: dict[Any, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for position, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        if dst.numel() >= LARGE_COPY_NUMEL:
            key: Any = ("alone", position)
        elif dst.is_contiguous() and src.is_contiguous():
            key = (dst.dtype, src.dtype)
        else:
            key = None
        group = groups.get(key)
        if group is None:
            group = groups[key] = ([], [])
        group[0].append(dst)
        group[1].append(src)
    return list(groups.values())


def _fill(slots: Sequence[torch.Tensor], sources: Sequence[RefitSource]) -> None:
    """Cast every source straight into its slot (one pass), in grouped launches."""
    grouped_copy_(slots, [s.tensor for s in sources], non_blocking=True)


# ----------------------------------------------------------------------------- sender


class ZmqIpcSender:
    """The trainer side: a REQ socket in a private folder; streams one refit per ``stream`` call."""

    def __init__(self, *, rank: int) -> None:
        self.rank = rank
        remove_orphans()  # what senders killed earlier left in /dev/shm and the temp folder
        self._dir, self._dir_fd = _create_locked_dir()
        self.address = f"ipc://{self._dir}/rank{rank}.sock"
        self._context: zmq.Context[Any] | None = zmq.Context()
        self._socket: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None  # connection events: counts the receivers
        self._peers = 0
        # One thread at a time uses the socket (libzmq sockets are not thread-safe: two refits
        # at once aborted the process); a second thread is refused, not queued.
        self._busy = threading.RLock()
        self._staging_refs: list[weakref.ref[torch.Tensor]] = []
        self._kept: list[Staging] = []  # ping-pong buffers kept by a keep_staging refit
        self._kept_bytes = 0
        self._plan: Sequence[IpcBucket] | None = None  # the plan the staging caches were made for
        self._manifest: tuple[Sequence[TensorSpec], bytes] | None = None  # (specs object, frame)
        try:
            fix = (
                "set TMPDIR to a shorter folder (e.g. TMPDIR=/tmp) for the trainer process: "
                "the socket lives in a private folder there"
            )
            check_ipc_address(self.address, fix=fix)
            self._sock()  # bind now: a bad address fails here, not at the first refit
        except BaseException:
            self._teardown()
            raise

    @contextlib.contextmanager
    def _exclusive(self, call: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            msg = (
                f"refit rank {self.rank}: {call} was called while another thread is streaming a "
                "refit on this sender; refits of one worker run one at a time: wait for the "
                "other call to return, then call again"
            )
            raise RefitError(msg)
        try:
            if self._context is None:
                msg = f"refit rank {self.rank}: {call} after close(); this sender is closed"
                raise RefitError(msg)
            yield
        finally:
            self._busy.release()

    @property
    def live_staging_bytes(self) -> int:
        """Bytes of staging tensors of the last stream still alive (0 once they are freed)."""
        return sum(t.numel() for t in (r() for r in self._staging_refs) if t is not None)

    @property
    def kept_staging_bytes(self) -> int:
        """Bytes of the ping-pong buffers kept for the next refit (``keep_staging=True``)."""
        return sum(s.size for s in self._kept)

    def release_staging(self) -> None:
        """Free the kept staging buffers (before an offload, or to return the memory for good)."""
        with self._exclusive("release_staging"):
            self._release_staging()

    def _release_staging(self) -> None:
        kept, self._kept, self._kept_bytes = self._kept, [], 0
        cuda = any(isinstance(s, CudaStaging) for s in kept)
        for staging in kept:
            staging.close()
        if cuda:
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()

    def _sock(self) -> zmq.Socket[Any]:
        sock = self._socket
        if sock is None:
            assert self._context is not None
            sock = self._context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES)
            self._socket = sock
            sock.bind(self.address)
            self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            self._peers = 0
        return sock

    def _close_socket(self) -> None:
        if self._monitor is not None:
            assert self._socket is not None
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _rebuild(self) -> None:
        self._close_socket()
        self._sock()

    def connected_receivers(self) -> int:
        """How many receivers are connected to this sender's address right now."""
        # the monitor reports plain ints; zmq.Event members hash equal to them
        peer_delta: dict[int, int] = {zmq.EVENT_ACCEPTED: 1, zmq.EVENT_DISCONNECTED: -1}
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            self._peers += peer_delta.get(event, 0)
        return self._peers

    def _check_one_receiver(self) -> None:
        """REQ sends each message to the next connected peer in turn: with two receivers on one
        address each would see part of a refit. Refuse before BEGIN (a receiver that just rebuilt
        its socket is counted twice for a moment, so give disconnects a short while to arrive)."""
        deadline = time.monotonic() + 0.5
        while (count := self.connected_receivers()) > 1:
            if time.monotonic() > deadline:
                msg = (
                    f"refit rank {self.rank}: {count} receivers are connected to {self.address}; "
                    "one sender streams to exactly one receiver (each would get part of the "
                    "refit). "
                    "Close the extra receivers on this address (each engine rank connects to its "
                    "own trainer rank's get_zmq_address())"
                )
                raise RefitError(msg)
            time.sleep(0.01)

    def _timeout(self, phase: str, timeout_s: float) -> RefitTimeoutError:
        self._rebuild()
        msg = (
            f"refit rank {self.rank}: no progress in phase {phase!r} within {timeout_s:g} s at "
            f"{self.address}; "
            "the receiver may be dead or unresponsive. The sender rebuilt its socket: start a "
            "receiver "
            "on this address and call stream_weights_via_ipc_zmq again."
        )
        return RefitTimeoutError(msg)

    def _send(self, frames: list[bytes], *, phase: str, timeout_s: float) -> None:
        sock = self._sock()
        sock.setsockopt(zmq.SNDTIMEO, _ms(timeout_s))
        try:
            sock.send_multipart(frames)  # small frames: copying beats zero-copy bookkeeping
        except zmq.Again:
            raise self._timeout(phase, timeout_s) from None

    def _reply(self, *, phase: str, timeout_s: float) -> Reply:
        sock = self._sock()
        sock.setsockopt(zmq.RCVTIMEO, _ms(timeout_s))
        try:
            frames = sock.recv_multipart()
        except zmq.Again:
            raise self._timeout(phase, timeout_s) from None
        reply = decode_reply(frames)
        if not reply.ok:
            msg = f"refit rank {self.rank}: the receiver rejected {phase}: {reply.reason}"
            raise RefitRejectedError(msg)
        return reply

    def _begin_frames(self, specs: Sequence[TensorSpec], transport: str) -> list[bytes]:
        if (
            self._manifest is None or self._manifest[0] is not specs
        ):  # encoded once per specs object
            self._manifest = (specs, encode_manifest(specs))
        return encode(
            Begin(self.rank, transport, DEFAULT_ALIGNMENT, tuple(specs)),
            manifest_frame=self._manifest[1],
        )

    def stream(
        self,
        specs: Sequence[TensorSpec],
        plan: Sequence[IpcBucket],
        sources: Iterator[RefitSource],
        *,
        make_staging: Callable[[int], Staging],
        buffer_bytes: int,
        timeout_s: float,
        transport: str,
        keep_staging: bool = False,
    ) -> dict[str, Any]:
        """One refit: BEGIN, the planned buckets through two ping-pong buffers, COMPLETE.

        Returns the receiver's report. By default the staging buffers are freed before COMPLETE
        is sent. ``keep_staging=True`` keeps the two ping-pong buffers (and their cached slot
        views and frames) for the next refit with the same ``buffer_bytes`` until
        ``release_staging`` or ``close``; the receiver then keeps its mappings too. On any
        failure every staging buffer, kept or not, is freed before this raises.
        """
        with self._exclusive("stream_weights_via_ipc_zmq"):
            self._check_one_receiver()
            return self._stream(
                specs,
                plan,
                sources,
                make_staging=make_staging,
                buffer_bytes=buffer_bytes,
                timeout_s=timeout_s,
                transport=transport,
                keep_staging=keep_staging,
            )

    def _stream(
        self,
        specs: Sequence[TensorSpec],
        plan: Sequence[IpcBucket],
        sources: Iterator[RefitSource],
        *,
        make_staging: Callable[[int], Staging],
        buffer_bytes: int,
        timeout_s: float,
        transport: str,
        keep_staging: bool,
    ) -> dict[str, Any]:
        if any(not s.intact() for s in self._kept):  # e.g. a kept file truncated meanwhile
            self._release_staging()
        if self._kept and (
            self._kept_bytes != buffer_bytes
            or not all(isinstance(s, CudaStaging) == (transport == "cuda") for s in self._kept)
        ):
            self._release_staging()
        if plan is not self._plan:  # cached slot views / frames belong to one plan object
            for staging in self._kept:
                staging.cache.clear()
            self._plan = plan
        ping_pong: list[Staging | None] = [*self._kept, None, None][:2]
        self._kept, self._kept_bytes = [], 0
        self._staging_refs = [
            weakref.ref(s.tensor) for s in ping_pong if s is not None and s.tensor is not None
        ]
        pending: str | None = None  # phase of the request whose reply is still owed
        pending_staging: Staging | None = None  # the buffer that request's bucket is in
        begun = False

        def new_staging(nbytes: int) -> Staging:
            staging = make_staging(nbytes)
            assert staging.tensor is not None
            self._staging_refs.append(weakref.ref(staging.tensor))
            return staging

        def new_ping_pong() -> None:
            """Both buffers from one allocation when at least two buckets will use them."""
            if sum(not b.oversized for b in plan) < 2:
                ping_pong[0] = new_staging(buffer_bytes)
                return
            whole = make_staging(2 * buffer_bytes)
            ping_pong[:] = whole.halves(buffer_bytes)
            self._staging_refs.extend(
                weakref.ref(s.tensor) for s in ping_pong if s is not None and s.tensor is not None
            )

        def release() -> None:
            for i, staging in enumerate(ping_pong):
                if staging is not None:
                    staging.close()
                    ping_pong[i] = None

        def request(frames: list[bytes], phase: str, staging: Staging | None = None) -> None:
            nonlocal pending, pending_staging
            settle()
            self._send(frames, phase=phase, timeout_s=timeout_s)
            pending, pending_staging = phase, staging

        def settle() -> Reply | None:
            nonlocal pending, pending_staging
            if pending is None:
                return None
            (owed, pending), (staging, pending_staging) = (pending, None), (pending_staging, None)
            reply = self._reply(phase=owed, timeout_s=timeout_s)
            if staging is not None:
                staging.note_consumed(reply.consumed_event)
            return reply

        def prepared(
            staging: Staging, seq: int, bucket: IpcBucket, keep: bool
        ) -> tuple[list[torch.Tensor], list[bytes]]:
            """The bucket's slot views and encoded frames in this buffer.

            Cached with the buffer.
            """
            hit = staging.cache.get((seq, keep))
            if hit is None:
                base = staging.base  # where this half starts in the shared buffer
                frames = encode(
                    Bucket(
                        seq,
                        staging.ref(keep=keep),
                        bucket.indices,
                        tuple(base + o for o in bucket.offsets),
                        base + bucket.used_bytes,
                    )
                )
                hit = staging.cache[(seq, keep)] = (_slots(staging, bucket, specs), frames)
            return hit

        def take(bucket: IpcBucket) -> list[RefitSource]:
            items = [next(sources) for _ in bucket.indices]
            for i, item in zip(bucket.indices, items, strict=True):
                want = specs[i]
                if (
                    item.name != want.name
                    or item.dtype != want.dtype
                    or item.tensor.shape != want.shape
                ):
                    msg = (
                        f"internal: the params stream sent {item.spec} where prepare_refit_info "
                        f"said {want}"
                    )
                    raise RefitError(msg)
            return items

        self._note_wait(timeout_s)
        try:
            request(self._begin_frames(specs, transport), "begin")
            begun = True  # its reply is settled by the first bucket's request: the receiver checks
            turn = 0  # the manifest while the first buffer is allocated and filled
            for seq, bucket in enumerate(plan):
                items = take(bucket)
                if bucket.oversized:
                    settle()  # the ping-pong buffer in flight is free; now send this one alone
                    alone = new_staging(bucket.used_bytes)
                    try:
                        slots, frames = prepared(alone, seq, bucket, False)
                        _fill(slots, items)
                        del slots
                        alone.mark_filled()
                        request(frames, f"bucket {seq} (oversized)", alone)
                        settle()
                        alone.wait_for_reader()  # the allocator may hand its block out again
                    finally:
                        alone.close()
                    continue
                slot = turn % 2
                turn += 1
                if ping_pong[0] is None and ping_pong[1] is None:
                    new_ping_pong()
                if ping_pong[slot] is None:
                    ping_pong[slot] = new_staging(buffer_bytes)
                staging = ping_pong[slot]
                assert staging is not None
                slots, frames = prepared(staging, seq, bucket, keep_staging)
                staging.wait_for_reader()
                _fill(
                    slots, items
                )  # queued behind the receiver's reads of this buffer's last bucket
                del slots, items
                staging.mark_filled()
                request(frames, f"bucket {seq}", staging)
            settle()
            if keep_staging:
                self._kept = [s for s in ping_pong if s is not None]
                self._kept_bytes = buffer_bytes
                ping_pong[:] = [None, None]
            else:
                for staging in ping_pong:
                    if staging is not None:
                        staging.wait_for_reader()
                release()
                if transport == "cuda":
                    torch.cuda.empty_cache()
            request(encode(Complete(len(plan))), "complete")
            reply = settle()
            begun = False
            assert reply is not None
            for staging in self._kept:
                staging.forget_consumed()
            return reply.report
        except BaseException as exc:
            try:
                # A timeout rebuilt the socket and a rejection already ended the receiver's
                # refit; any other failure (our own) is announced so the receiver stops waiting
                # at once. Before the staging goes: the receiver may still be reading the
                # bucket whose reply is owed.
                if begun and not isinstance(exc, (RefitTimeoutError, RefitRejectedError)):
                    self._abort(pending, f"{type(exc).__name__}: {exc}", timeout_s=timeout_s)
            finally:
                release()
                self._release_staging()
            raise
        finally:
            if transport == "cuda":
                torch.cuda.ipc_collect()

    def _note_wait(self, timeout_s: float) -> None:
        """Log where the sender waits when no receiver is connected yet (REQ is not writable)."""
        if not self._sock().poll(0, zmq.POLLOUT):
            log.info(
                "refit rank %d: waiting up to %g s for a receiver at %s (build "
                "HFWeightReceiver(address=...) there and call receive())",
                self.rank,
                timeout_s,
                self.address,
            )

    def _abort(self, pending: str | None, reason: str, *, timeout_s: float) -> None:
        """Tell the receiver the refit is off (best effort; rebuild the socket on failure).

        The reply owed for ``pending`` is awaited first, as long as any reply (the receiver is
        still reading that bucket). A rejection there means the receiver already ended its refit:
        no ABORT is sent, so none can wait in its queue for the next refit. The ABORT's own reply
        gets a short wait: a receiver that is slow to roll back still handles it in this refit.
        """
        try:
            if pending is not None:
                self._sock().setsockopt(zmq.RCVTIMEO, _ms(timeout_s))
                if not decode_reply(self._sock().recv_multipart()).ok:
                    return
            self._sock().setsockopt(zmq.SNDTIMEO, _ms(_ABORT_TIMEOUT_S))
            self._sock().send_multipart(encode(Abort(reason[:4096])))
            self._sock().setsockopt(zmq.RCVTIMEO, _ms(_ABORT_TIMEOUT_S))
            self._sock().recv_multipart()
        except (zmq.ZMQError, ProtocolError):
            self._rebuild()

    def close(self) -> None:
        """Free the staging, the socket and its folder (idempotent; refused while another thread
        streams a refit on this sender)."""
        if self._context is None:
            return
        with self._exclusive("close"):
            self._release_staging()
            self._teardown()

    def _teardown(self) -> None:
        """Close every socket, then the context (which cannot block: no socket is left open),
        then remove the folder and drop its lock."""
        self._close_socket()
        if self._context is not None:
            self._context.term()
            self._context = None
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


# ----------------------------------------------------------------------------- receiver


class WeightSink(Protocol):
    """Where a refit lands (``receiver.WeightApplier``): validated first, written second."""

    def begin(self, manifest: Sequence[TensorSpec]) -> None: ...
    def apply_batch(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None: ...
    def apply_indexed(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> None: ...
    def prepare(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> Any: ...
    def apply_prepared(self, batch: Any) -> None: ...
    def commit(self, *, num_buckets: int) -> Any: ...
    def abort(self, reason: str) -> None: ...


class _Mapped:
    """One opened staging buffer, the source views of the buckets it carried and, for CUDA, per
    region of the buffer the sender fills (a ping-pong half, named by its filled-event handle):
    the sender's filled event (opened once) and this side's consumed event."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.views: dict[
            tuple[Any, ...], Any
        ] = {}  # (indices, offsets) -> the sink's prepared batch
        self._events: dict[bytes, tuple[torch.cuda.Event, torch.cuda.Event, bytes]] = {}

    def wait_filled(self, filled_handle: bytes) -> bytes:
        """Queue, on the current stream, a wait for the sender's casts into this region; the
        region's key for ``record_consumed``."""
        events = self._events.get(filled_handle)
        if events is None:
            if len(self._events) >= 64:  # a misbehaving sender must not grow this without bound
                self._events.clear()
            consumed = torch.cuda.Event(interprocess=True)
            consumed.record(
                torch.cuda.current_stream(self.tensor.device)
            )  # before its handle is taken
            filled = _open_event(self.tensor.device, filled_handle)
            events = self._events[filled_handle] = (filled, consumed, bytes(consumed.ipc_handle()))
        torch.cuda.current_stream(self.tensor.device).wait_event(events[0])
        return filled_handle

    def record_consumed(self, key: bytes) -> bytes:
        """Record the event the sender waits on, after the queued reads of the region.

        Returns its handle.
        """
        _, consumed, handle = self._events[key]
        consumed.record(torch.cuda.current_stream(self.tensor.device))
        return handle


class ReceivedBuffers:
    """Receiver-side mappings of the sender's staging buffers, by buffer identity.

    A buffer is opened once; after a complete refit only the mappings of buffers the sender
    keeps (``keep`` in their reference, used by that refit) stay open; a failed refit closes all.
    """

    def __init__(self) -> None:
        self._open: dict[Any, _Mapped] = {}
        self._used: dict[Any, bool] = {}  # key -> keep, for the refit in progress

    @staticmethod
    def _key(ref: ShmBuffer | CudaBuffer) -> Any:
        if isinstance(ref, ShmBuffer):
            return ("shm", ref.name, ref.size)
        return ("cuda", ref.device_uuid, ref.handle, ref.storage_offset_bytes, ref.size)

    def open(self, ref: ShmBuffer | CudaBuffer) -> _Mapped:
        key = self._key(ref)
        mapped = self._open.get(key)
        if mapped is not None and isinstance(ref, ShmBuffer):
            problem = _shm_problem(ref)  # a kept file truncated since: reading it would SIGBUS
            if problem is not None:
                del self._open[key]
                raise ProtocolError(f"{problem} (it shrank or went away since it was mapped)")
        if mapped is None:
            mapped = self._open[key] = _Mapped(
                _open_shm(ref) if isinstance(ref, ShmBuffer) else _open_cuda(ref)
            )
        self._used[key] = ref.keep
        return mapped

    def finish(self, *, ok: bool) -> None:
        """End of a refit: keep only the kept buffers it used (none when it failed)."""
        keep = {k for k, kept in self._used.items() if kept} if ok else set()
        self._open = {k: m for k, m in self._open.items() if k in keep}
        self._used = {}

    def clear(self) -> None:
        self._open.clear()
        self._used.clear()

    def forget_views(self) -> None:
        """Drop the cached bucket views (they were built for another manifest)."""
        for mapped in self._open.values():
            mapped.views.clear()

    def __len__(self) -> int:
        return len(self._open)


def _shm_problem(ref: ShmBuffer) -> str | None:
    """Why the named staging file cannot be read safely through a mapping of ``ref.size``
    bytes (reading past a file's end is a SIGBUS, not an error); None when it can."""
    path = os.path.join(SHM_DIR, ref.name)  # the name was checked against a strict pattern
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"shared-memory buffer {ref.name!r} does not exist in {SHM_DIR}"
    if (
        not stat.S_ISREG(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_size < max(ref.size, 1)
    ):
        return (
            f"shared-memory buffer {ref.name!r} is not a regular file of this user with >= "
            f"{ref.size} bytes (it has {info.st_size})"
        )
    return None


def _open_shm(ref: ShmBuffer) -> torch.Tensor:
    problem = _shm_problem(ref)
    if problem is not None:
        raise ProtocolError(problem)
    path = os.path.join(SHM_DIR, ref.name)
    return torch.from_file(path, shared=True, size=max(ref.size, 1), dtype=torch.uint8)[: ref.size]


def _open_cuda(ref: CudaBuffer) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuids = [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    ]
    if ref.device_uuid not in uuids:
        msg = (
            f"CUDA buffer on device {ref.device_uuid} is not visible here (visible: {uuids}); "
            "colocate the receiver"
        )
        raise ProtocolError(msg)
    index = uuids.index(ref.device_uuid)
    return rebuild_cuda_tensor(
        torch.Tensor,
        (ref.size,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        index,
        ref.handle,
        ref.size,
        ref.storage_offset_bytes,
        False,
        ref.ref_counter_handle,
        ref.ref_counter_offset,
        ref.event_handle or None,
        ref.event_sync_required,
    )


@attrs.frozen
class Outcome:
    """What one handled message means for the serving loop."""

    done: bool = False
    report: Any = None
    error: RefitError | None = None


class RefitServer:
    """The receiver's protocol state machine.

    Frames in, reply frames + outcome out; never raises.
    """

    def __init__(self, sink: WeightSink) -> None:
        self.sink = sink
        self._manifest: tuple[TensorSpec, ...] | None = None
        self._views_manifest: tuple[TensorSpec, ...] | None = None
        self._manifests = ManifestCache()
        self._sizes: tuple[int, ...] = ()
        self._alignment = DEFAULT_ALIGNMENT
        self._received = bytearray()
        self._count = 0
        self._buffers = ReceivedBuffers()
        self._num_buckets = 0
        self._gpu_pending: torch.device | None = None  # a device with reads queued but not awaited
        # per (indices, offsets) of this manifest: how to cut a bucket out of a fresh mapping with
        # one split (None: it needs unpack_tensors); kept across refits that free their staging
        self._layouts: dict[tuple[Any, ...], SplitLayout | None] = {}

    @property
    def in_refit(self) -> bool:
        return self._manifest is not None

    @property
    def open_buffers(self) -> int:
        """Staging buffers mapped right now (kept ones stay mapped between refits)."""
        return len(self._buffers)

    def release_buffers(self) -> None:
        """Close every kept mapping (the sender's kept staging can then really be freed)."""
        if self._manifest is None:
            self._buffers.clear()

    def handle(self, frames: Sequence[bytes]) -> tuple[list[bytes], Outcome]:
        kind, seq = "unknown", -1
        try:
            message = decode_request(frames, manifests=self._manifests)
            kind = type(message).__name__.lower()
            if isinstance(message, Bucket):
                seq = message.seq
            return self._dispatch(message)
        except Exception as exc:  # a bad message must be answered, never crash the receiver
            reason = str(exc) if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
            self.fail(reason)
            error = RefitError(f"refit rejected ({kind}): {reason}")
            return encode(Reply(False, kind, seq, reason)), Outcome(done=True, error=error)

    def _drain_gpu(self) -> None:
        """Wait for every queued read of the sender's buffers (before closing their mappings)."""
        if self._gpu_pending is not None:
            torch.cuda.current_stream(self._gpu_pending).synchronize()
            self._gpu_pending = None

    def fail(self, reason: str) -> None:
        """Drop the refit in progress.

        The sink keeps the previous version or marks itself stale.
        """
        self._drain_gpu()
        if self._manifest is not None:
            self.sink.abort(reason)
        self._manifest = None
        self._received = bytearray()
        self._buffers.finish(ok=False)

    def _dispatch(self, message: Begin | Bucket | Complete | Abort) -> tuple[list[bytes], Outcome]:
        if isinstance(message, Begin):
            if self._manifest is not None:
                raise ProtocolError("BEGIN while a refit is in progress; finish or abort it first")
            self.sink.begin(message.manifest)
            if message.manifest is not self._views_manifest:  # cached views hold its dtypes/shapes
                self._buffers.forget_views()
                self._layouts.clear()
                self._views_manifest = message.manifest
            self._manifest = message.manifest
            self._sizes = (
                self._manifests.sizes
                if message.manifest is self._manifests.specs
                else tuple(s.nbytes for s in message.manifest)
            )
            self._alignment, self._num_buckets = message.alignment, 0
            self._received, self._count = bytearray(len(message.manifest)), 0
            return encode(Reply(True, "begin")), Outcome()
        if isinstance(message, Abort):
            if self._manifest is None:
                # Nothing to abort: a sender sends ABORT only after BEGIN, so this one belongs to
                # a refit this side already ended (rejected, timed out). Answered and dropped;
                # the refit this receive() waits for is still to come.
                return encode(Reply(True, "abort")), Outcome()
            self.fail(f"sender aborted: {message.reason}")
            error = RefitError(f"the sender aborted the refit: {message.reason}")
            return encode(Reply(True, "abort")), Outcome(done=True, error=error)
        if self._manifest is None:
            raise ProtocolError(f"{type(message).__name__.upper()} before BEGIN")
        if isinstance(message, Complete):
            return self._complete(message)
        return self._bucket(message)

    def _bucket(self, bucket: Bucket) -> tuple[list[bytes], Outcome]:
        manifest = self._manifest
        assert manifest is not None
        problems = check_bucket(
            bucket,
            manifest,
            self._sizes,
            self._received,
            alignment=self._alignment,
            buffer_size=bucket.buffer.size,
        )
        if problems:
            raise ProtocolError(
                f"bucket {bucket.seq} rejected before any write: " + "; ".join(problems[:20])
            )
        mapped = self._buffers.open(bucket.buffer)
        key = (bucket.indices, bucket.offsets)  # for this manifest (see BEGIN); valid while mapped
        batch = mapped.views.get(key)
        if batch is None:
            if len(mapped.views) > 4096:  # a misbehaving sender must not grow this without bound
                mapped.views.clear()
            buffer = mapped.tensor[: bucket.buffer.size]
            specs = [manifest[i] for i in bucket.indices]
            if key not in self._layouts:
                if len(self._layouts) > 4096:
                    self._layouts.clear()
                self._layouts[key] = split_layout(specs, bucket.offsets)
            layout = self._layouts[key]
            if layout is not None and buffer.data_ptr() % layout.dtype.itemsize == 0:
                views = split_views(buffer, layout)
            else:
                views = unpack_tensors(buffer, specs, bucket.offsets)
            batch = self.sink.prepare(bucket.indices, views)
            if bucket.buffer.keep:
                mapped.views[key] = batch
        consumed = b""
        if isinstance(bucket.buffer, CudaBuffer):
            region = mapped.wait_filled(bucket.buffer.filled_event)
            self._gpu_pending = mapped.tensor.device
            self.sink.apply_prepared(batch)
            consumed = mapped.record_consumed(region)  # the sender's next write there waits on it
        else:
            self.sink.apply_prepared(batch)
        del batch
        received = self._received
        for index in bucket.indices:
            received[index] = 1
        self._count += len(bucket.indices)
        self._num_buckets += 1
        return encode(Reply(True, "bucket", bucket.seq, consumed_event=consumed)), Outcome()

    def _complete(self, message: Complete) -> tuple[list[bytes], Outcome]:
        manifest = self._manifest
        assert manifest is not None
        if self._count != len(manifest):
            missing = [s.name for s, got in zip(manifest, self._received, strict=True) if not got]
            raise ProtocolError(f"COMPLETE with {len(missing)} tensors never sent: {missing[:20]}")
        self._drain_gpu()  # the new version is in place before anyone is told so
        self._buffers.finish(ok=True)
        report = self.sink.commit(num_buckets=self._num_buckets)
        self._manifest = None
        summary = (
            attrs.asdict(report, filter=lambda a, _: a.name != "names")
            if attrs.has(type(report))
            else {}
        )
        return encode(Reply(True, "complete", report=summary)), Outcome(done=True, report=report)


class ZmqIpcReceiver:
    """The inference side's REP socket: serves one refit per ``serve`` call, every wait bounded.

    ``max_message_bytes`` caps every frame (ZMQ drops a peer that sends a larger one before
    reading it, so a bogus 1 GiB frame costs nothing). ``close()`` may be called from any thread:
    a ``serve`` waiting in another thread raises ``ReceiverClosedError`` within ~50 ms (or when
    its current bucket is applied), and only the thread inside ``serve`` touches the socket.
    """

    def __init__(
        self, address: str, *, timeout_s: float, max_message_bytes: int | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._serving = threading.Lock()  # held by the thread inside serve()
        self._closed = threading.Event()
        self._context: zmq.Context[Any] | None = zmq.Context()
        self._socket: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None  # connection events of the socket
        self._dropped = False  # ZMQ dropped the connection for good (a frame over the cap)
        try:
            check_ipc_address(address, fix="the sender's get_zmq_address() is always short enough")
            self._connect()
        except BaseException:
            self._release()  # the socket and context go with the failed construction
            raise

    def _connect(self) -> None:
        assert self._context is not None
        sock = self._context.socket(zmq.REP)
        self._socket = sock
        sock.setsockopt(zmq.LINGER, 0)
        if self._max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        self._dropped = False
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            msg = (
                f"refit receiver cannot connect to {self.address!r}: {exc}; pass the "
                "sender's get_zmq_address()"
            )
            raise ValueError(msg) from None

    def _close_socket(self) -> None:
        if self._monitor is not None:
            assert self._socket is not None
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _reconnect(self) -> None:
        self._close_socket()
        self._connect()

    def _connection_dropped(self) -> bool:
        """True when the connection ended without a reconnect scheduled: ZMQ does not reconnect
        after dropping a peer for a frame over MAXMSGSIZE, so the socket must be rebuilt."""
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            self._dropped = event == zmq.EVENT_DISCONNECTED
        return self._dropped

    def _release(self) -> None:
        """Close the sockets, then the context (term cannot block: no socket is left open)."""
        self._close_socket()
        if self._context is not None:
            self._context.term()
            self._context = None

    def serve(self, server: RefitServer) -> Any:
        """Answer messages until the refit completes (its report) or fails (``RefitError``)."""
        if not self._serving.acquire(blocking=False):
            msg = (
                f"refit receiver at {self.address}: receive() is already running in another "
                "thread; one receive() at a time per receiver"
            )
            raise RefitError(msg)
        try:
            return self._serve(server)
        finally:
            if self._closed.is_set():  # close() came while we served: the socket is ours to close
                self._release()
            self._serving.release()

    def _closed_error(self, phase: str) -> ReceiverClosedError:
        return ReceiverClosedError(
            f"refit receiver at {self.address} was closed while receive() "
            f"waited in phase {phase!r}; a refit in progress was dropped"
        )

    def _recv(self, server: RefitServer, phase: str, started: float) -> list[bytes]:
        """The next message, polling in short slices so that close() is noticed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._closed.is_set() or self._socket is None:
                server.fail("the receiver was closed")
                raise self._closed_error(phase)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._socket.poll(min(_POLL_SLICE_MS, _ms(left)), zmq.POLLIN):
                with contextlib.suppress(zmq.Again):
                    return self._socket.recv_multipart(zmq.NOBLOCK, copy=True)
        server.fail(f"timed out waiting for {phase}")
        if phase != "begin" or self._connection_dropped():
            # Mid-refit, the sender is gone or stuck; start clean. An idle wait keeps a live
            # connection: rebuilding it would drop a BEGIN arriving at that moment (a retry race).
            self._reconnect()
        msg = (
            f"refit receiver: no message in phase {phase!r} within {self.timeout_s:g} s at "
            f"{self.address} ({time.monotonic() - started:.1f} s into receive()); is the sender "
            "streaming?"
        )
        raise RefitTimeoutError(msg)

    def _serve(self, server: RefitServer) -> Any:
        started = time.monotonic()
        phase = "begin"
        while True:
            frames = self._recv(server, phase, started)
            reply, outcome = server.handle(frames)
            assert self._socket is not None
            self._socket.setsockopt(zmq.SNDTIMEO, _ms(self.timeout_s))
            try:
                self._socket.send_multipart(reply)
            except zmq.Again:
                server.fail("could not send a reply")
                self._reconnect()  # a REP that owes a reply cannot receive again
                raise RefitTimeoutError(
                    f"refit receiver: could not reply at {self.address} within {self.timeout_s:g} s"
                ) from None
            if outcome.error is not None:
                raise outcome.error
            if outcome.done:
                return outcome.report
            phase = "bucket or complete" if server.in_refit else "begin"

    def close(self) -> None:
        """Close from any thread; returns within ~2 s even while another thread serves."""
        self._closed.set()
        if self._serving.acquire(timeout=_CLOSE_WAIT_S):
            try:
                self._release()
            finally:
                self._serving.release()
        # else: the serving thread is applying a bucket; it releases the socket when it returns


def expected_from_refit_info(
    refit_info: Mapping[str, Any],
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Normalise ``{name: (shape, dtype)}`` metadata (shapes as lists or Sizes)."""
    return {name: (torch.Size(shape), dtype) for name, (shape, dtype) in refit_info.items()}

"""Colocated refit over ZMQ: ping-pong staging buffers shared by CUDA IPC or POSIX shared memory.

Sender (``ZmqIpcSender``, a DEALER socket bound in a private 0700 folder) and receiver
(``ZmqIpcReceiver``, a REP socket, driving a ``RefitServer``) speak the protocol of
docs/refit-protocol.md through ``functional.wire.codec``: BEGIN (manifest) → BUCKET* →
COMPLETE, each answered by one reply naming its request; a rejection or an ABORT ends the refit
on both sides at once. Buffers: CUDA tensors shared by their ``_share_cuda_()`` handle, or files
in /dev/shm on CPU (filled through a mapping, read by descriptor) — the same protocol code either
way, so CPU tests cover it.

Per-refit host work is kept small: the sender caches the encoded manifest per specs object and,
per staging buffer, each bucket's typed slot views and message record; with ``keep_staging`` the
two ping-pong buffers survive the refit (and so do those caches). The receiver keeps its last
manifest parse, opens each buffer once while the sender keeps it, and caches each bucket's
source views and destinations, so a bucket costs one JSON parse, one check loop and one grouped
copy launch.

The transport lives in these modules, one responsibility each; this one names their public
classes, so ``from policyworker.shell.refit.zmq import ...`` works:

- ``ipc_files``: socket folders, staging files, orphan removal, ``SHM_DIR`` and OS limits;
- ``staging``: ``ShmStaging`` / ``CudaStaging`` and the grouped copies;
- ``shared_buffers``: opening a peer's buffer (``SharedFile``: a /dev/shm file by descriptor);
- ``sender``: ``ZmqIpcSender`` (the socket, refit ids, replies bound to requests);
- ``staged``: ``StagedRefit`` (one staged refit's pipelined requests and ping-pong buffers);
- ``server``: ``RefitServer`` (the receiver's state machine) and ``ReceivedBuffers``;
- ``receiver``: ``ZmqIpcReceiver`` (the receiver's socket loop);
- ``checks``: the receiver's address checks and its early refusal.

The two module-level knobs are not named here, so nobody sets a copy that the code never reads:
``ipc_files.SHM_DIR`` (where CPU staging files live) and ``staging.LARGE_COPY_NUMEL``.
"""

from policyworker.shell.refit.zmq.ipc_files import (
    IPC_PATH_MAX_BYTES,
    StagingSpaceError,
    check_ipc_address,
    remove_orphans,
    shm_free_bytes,
)
from policyworker.shell.refit.zmq.receiver import (
    ReceiverClosedError,
    ZmqIpcReceiver,
    expected_from_refit_info,
)
from policyworker.shell.refit.zmq.sender import ZmqIpcSender
from policyworker.shell.refit.zmq.server import Outcome, ReceivedBuffers, RefitServer, WeightSink
from policyworker.shell.refit.zmq.staging import (
    CudaStaging,
    ShmStaging,
    copy_groups,
    grouped_copy_,
    run_copy_groups,
)

__all__ = [
    "IPC_PATH_MAX_BYTES",
    "ReceiverClosedError",
    "StagingSpaceError",
    "check_ipc_address",
    "remove_orphans",
    "shm_free_bytes",
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
    "Outcome",
    "expected_from_refit_info",
]

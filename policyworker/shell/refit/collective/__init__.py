"""Non-colocated refit: a packed broadcast from trainer rank 0 over a separate process group.

``init_collective`` builds a process group of trainer ranks ``0..T-1`` and inference ranks
``T+i`` over a ``TCPStore`` (NCCL on CUDA, gloo on CPU) without touching the default group.
One refit (``CollectiveRefit.broadcast_weights`` on every trainer rank,
``CollectiveWeightReceiver.receive`` on every inference rank) is, on the wire:

1. header: a broadcast of ``int64[2] = [MAGIC, n]``, then of ``n`` bytes of JSON (protocol,
   version, refit sequence number, layout, target bucket bytes, ``num_buffers``, alignment,
   manifest ``[[name, dtype, shape], ...]``). Both sides plan the buckets from THIS header, so
   bucket boundaries and buffer counts agree by construction (no local defaults on receivers);
2. agreement: an all-reduce of one flag per rank; a rank that rejects the header (manifest
   against its ``refit_info``, protocol version) sets its flag and every rank stops at once;
3. buckets: one broadcast per planned bucket, ``num_buffers`` in flight (one CUDA stream per
   slot on the sender); receivers post ``num_buffers`` receives ahead and apply each bucket
   through ``HFWeightReceiver`` (validate, then write / stage);
4. status: an all-reduce of one flag per rank; receivers commit only if every rank applied
   everything (so ``atomic=True`` receivers keep the previous version on any failure).

Layouts (docs/refit-collective.md): ``aligned`` (default) packs each bucket with
``plan_ipc_buckets`` -- tensors at 512-byte offsets, a bucket never exceeds the target except a
single oversized tensor sent alone -- so every received slice is dtype-aligned and viewed without
a copy; ``legacy`` (``use_legacy_packing=True``) is the reference layout: plain concatenation, a
bucket closed right after the tensor that crosses the target.

Every wait polls its collective with a deadline (the group's ``timeout_s``, or
``refit_timeout_s`` when given, which also arms a ``Watchdog`` thread that aborts the group). A
wait past its deadline, or a peer whose connection drops, marks the group broken and raises
``RefitTimeoutError`` naming rank, phase and peer count; build a new group (``init_collective``
on a fresh port, on every member) before the next refit.

The code: ``collective_plan`` (header codec, bucket plan, limits), ``collective_group``
(``CollectiveRefit``: the group, bounded waits, the trainer's broadcast),
``collective_receiver`` (``CollectiveWeightReceiver``) and, here, building the group
(``init_collective``) and the worker glue; every name stays importable from this module.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch.distributed re-exports these without `as`, so the checker sees them as private there.
from torch._C._distributed_c10d import PrefixStore, TCPStore

from policyworker.functional.buckets import (
    DEFAULT_ALIGNMENT,
)
from policyworker.shell.refit.collective.group import CollectiveRefit
from policyworker.shell.refit.collective.plan import (
    CPU_DEFAULT_BUCKET_BYTES,
    CUDA_DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    MAGIC,
    PROTOCOL,
    PROTOCOL_VERSION,
    CollectiveHeader,
    PlannedBucket,
    RefitPeerLostError,
    decode_header,
    default_bucket_bytes,
    encode_header,
    plan_collective_buckets,
)
from policyworker.shell.refit.collective.receiver import CollectiveWeightReceiver
from policyworker.shell.refit.watchdog import check_timeout_s
from policyworker.shell.refit.weight_stream import refit_stream

__all__ = [
    "CPU_DEFAULT_BUCKET_BYTES",
    "CUDA_DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_ALIGNMENT",
    "DEFAULT_NUM_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "MAGIC",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "CollectiveHeader",
    "CollectiveRefit",
    "CollectiveWeightReceiver",
    "PlannedBucket",
    "RefitPeerLostError",
    "broadcast_model_weights",
    "cpu_offload_cycle",
    "decode_header",
    "default_bucket_bytes",
    "encode_header",
    "init_collective",
    "plan_collective_buckets",
]


def init_collective(
    ip: str,
    port: int,
    world_size: int,
    *,
    train_world_size: int,
    rank: int,
    device: torch.device | str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CollectiveRefit:
    """Join the refit group: trainer ranks ``0..T-1``, inference ranks ``T..world_size-1``.

    Rank 0 hosts the ``TCPStore`` at ``(ip, port)``. Blocks until every member joined (bounded by
    ``timeout_s``). The default process group, if any, is left untouched.

    Raises:
        ValueError: a size, rank, port or timeout is out of range.
    """
    if not (
        isinstance(world_size, int)
        and isinstance(train_world_size, int)
        and 1 <= train_world_size < world_size
    ):
        msg = (
            f"train_world_size {train_world_size!r} and world_size {world_size!r} must be ints "
            "with "
            "1 <= train_world_size < world_size (the group needs at least one inference rank)"
        )
        raise ValueError(msg)
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        msg = (
            f"rank {rank!r} must be an int in [0, {world_size}); trainer ranks keep their rank, "
            "inference rank i is T + i"
        )
        raise ValueError(msg)
    if not (isinstance(port, int) and 0 < port < 65536):
        msg = (
            f"port {port!r} must be an int in [1, 65535]; every member must pass the same ip and "
            "port"
        )
        raise ValueError(msg)
    check_timeout_s("timeout_s", timeout_s)
    device = torch.device(device) if device is not None else torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(ip, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = PrefixStore("policyworker-collective-refit", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return CollectiveRefit(
        pg,
        store=store,
        rank=rank,
        world_size=world_size,
        train_world_size=train_world_size,
        device=device,
        timeout_s=timeout_s,
    )


# ----------------------------------------------------------------------------- worker glue


@contextlib.contextmanager
def cpu_offload_cycle(
    enabled: bool,
    onload: Callable[[], Any] | None,
    offload: Callable[[], Any] | None,
    *,
    transport: str,
) -> Iterator[None]:
    """With cpu_offload, move the model to the device for the transfer and back after."""
    if not enabled:
        yield
        return
    if onload is None or offload is None:
        msg = (
            f"cpu_offload=True needs both onload and offload callables for {transport}; pass the "
            "worker's moves"
        )
        raise ValueError(msg)
    warnings.warn(
        f"cpu_offload adds an onload/offload cycle around {transport} (the model is moved to the "
        "device "
        "and back)",
        stacklevel=3,
    )
    onload()
    try:
        yield
    finally:
        offload()


def broadcast_model_weights(
    group: CollectiveRefit | None,
    model: nn.Module,
    refit_dtype: torch.dtype,
    *,
    draft_model: nn.Module | None = None,
    kv_scales: Any = None,
    refit_timeout_s: float | None = None,
    buffer_size_bytes: int | None = None,
    num_buffers: int | None = None,
    use_legacy_packing: bool = False,
    cpu_offload: bool = False,
    onload: Callable[[], Any] | None = None,
    offload: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """``PolicyWorker.broadcast_weights_for_collective``.

    Sends the model's refit stream over ``group``.
    """
    if group is None:
        msg = (
            "broadcast_weights_for_collective needs a refit group: call init_collective(ip, "
            "port, world_size, ...) first"
        )
        raise ValueError(msg)
    if kv_scales is not None:
        msg = (
            "kv_scales: FP8 KV-cache scales are unsupported in this worker (no FP8 kvcache "
            "calibration path); "
            "pass kv_scales=None"
        )
        raise ValueError(msg)
    with cpu_offload_cycle(
        cpu_offload, onload, offload, transport="broadcast_weights_for_collective"
    ):
        stream = refit_stream(model, refit_dtype, draft_model)  # one walk: specs and tensors
        info = {s.name: (torch.Size(s.shape), s.dtype) for s in stream.specs}
        sources = ((s.name, s.tensor) for s in stream.sources)
        try:
            with torch.no_grad():  # the caller's grad mode comes back on every exit
                return group.broadcast_weights(
                    sources,
                    refit_info=info,
                    buffer_size_bytes=buffer_size_bytes,
                    num_buffers=num_buffers,
                    use_legacy_packing=use_legacy_packing,
                    refit_timeout_s=refit_timeout_s,
                )
        finally:
            sources.close()
            stream.sources.close()

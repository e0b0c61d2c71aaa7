"""The worker-side refit sender: metadata, the ZMQ address, and one colocated refit per call.

``RefitSender`` is composed by the PolicyWorker, which delegates ``prepare_refit_info``,
``get_zmq_address`` and ``stream_weights_via_ipc_zmq`` to it (docs/refit-protocol.md). It plans the
buckets from the same walk as the metadata (``params.refit_specs``), then streams the uncast
sources (``params.iter_refit_sources``), each cast straight into its staging slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from policyworker.errors import RefitError
from policyworker.functional.buckets import (
    IpcBucket,
    default_ipc_buffer_bytes_from,
    ipc_size_stats,
    plan_ipc_buckets,
    split_ipc_budget,
)
from policyworker.shell.refit.live_state import StateReader
from policyworker.shell.refit.one_pass.sender import OnePassWriter, stream_one_pass
from policyworker.shell.refit.watchdog import check_timeout_s
from policyworker.shell.refit.weight_stream import (
    RefitSource,
    RefitStream,
    refit_info,
    refit_stream,
)
from policyworker.shell.refit.zmq.ipc_files import shm_free_bytes
from policyworker.shell.refit.zmq.sender import Exchange, ZmqIpcSender
from policyworker.shell.refit.zmq.staging import CudaStaging, ShmStaging

__all__ = ["CPU_DEFAULT_BUFFER_BYTES", "CUDA_DEFAULT_BUFFER_CAP_BYTES", "RefitSender"]

CUDA_DEFAULT_BUFFER_CAP_BYTES = 1 << 30  # per buffer; enough to amortise each round trip
CPU_DEFAULT_BUFFER_BYTES = 64 << 20


def check_stream_args(
    buffer_size_bytes: Any,
    kv_scales: Any,
    timeout_s: Any,
    keep_staging: Any = None,
    one_pass: Any = None,
) -> None:
    """The argument rules of a ZMQ refit (a sharded worker checks them on every rank first)."""
    if kv_scales is not None:
        msg = (
            "kv_scales: FP8 KV-cache scales are unsupported in this worker (no FP8 KV-cache "
            "calibration path); pass kv_scales=None"
        )
        raise ValueError(msg)
    if (
        isinstance(buffer_size_bytes, bool)
        or not isinstance(buffer_size_bytes, int)
        or buffer_size_bytes < 0
    ):
        msg = f"buffer_size_bytes {buffer_size_bytes!r} must be an int >= 0 (0 = pick a default)"
        raise ValueError(msg)
    check_timeout_s("timeout_s", timeout_s)
    if keep_staging is not None and not isinstance(keep_staging, bool):
        msg = (
            f"keep_staging {keep_staging!r} must be True, False or None (None = the constructor's "
            "setting)"
        )
        raise ValueError(msg)
    if one_pass is not None and not isinstance(one_pass, bool):
        msg = (
            f"one_pass {one_pass!r} must be True, False or None (None = the constructor's setting)"
        )
        raise ValueError(msg)


class RefitSender:
    """Streams the current model's weights to a colocated receiver over ZMQ + CUDA IPC / shm."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        refit_dtype: torch.dtype,
        *,
        rank: int = 0,
        device: torch.device | str = "cpu",
        draft_model_fn: Callable[[], nn.Module | None] | None = None,
        keep_staging: bool = False,
        one_pass: bool | None = None,
    ) -> None:
        if one_pass is not None and not isinstance(one_pass, bool):
            msg = (
                f"one_pass {one_pass!r} must be None (the default: one-pass wherever the "
                "receiver registered its memory, else staged), True (one-pass only) or False "
                "(staged only)"
            )
            raise ValueError(msg)
        self.one_pass = one_pass
        self._one_pass_writer = OnePassWriter(rank)
        if not isinstance(keep_staging, bool):
            msg = (
                f"keep_staging {keep_staging!r} must be a bool (True keeps the staging buffers "
                "between refits)"
            )
            raise ValueError(msg)
        self._model_fn = model_fn
        self.keep_staging = keep_staging
        self._draft_model_fn = draft_model_fn or (lambda: None)
        self.refit_dtype = refit_dtype
        self.rank = rank
        self.device = torch.device(device)
        self._sender: ZmqIpcSender | None = None
        self._state_reader = StateReader()  # this sender's state-dict walks, refit after refit
        self._adapter_streams: Any = None  # its adapter walks (created by the first adapter refit)
        self._closed = False
        self._creating = threading.Lock()  # two threads asking for the address get one sender
        self._stats_key: Any = None
        self._stats: tuple[int, int] = (0, 0)
        self._plan_key: Any = None
        self._plan: list[IpcBucket] = []

    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{hf_name: (shape, dtype)}`` in send order, equal to what every refit sends."""
        return refit_info(self._model_fn(), self.refit_dtype, self._draft_model_fn())

    def _zmq(self) -> ZmqIpcSender:
        with self._creating:
            if self._closed:
                msg = (
                    f"refit rank {self.rank}: this refit sender was closed (the worker was shut "
                    "down); it opens no new address and streams no refit"
                )
                raise RefitError(msg)
            if self._sender is None:
                self._sender = ZmqIpcSender(rank=self.rank)
            return self._sender

    def get_zmq_address(self) -> str:
        """The ``ipc://`` address (in a private 0700 folder) a receiver connects to."""
        return self._zmq().address

    @property
    def departed_receivers(self) -> int:
        """How many receivers have disconnected from this address since its socket was bound
        (read it before replacing a receiver; see ``wait_for_receivers``)."""
        zmq = self._zmq()
        zmq.connected_receivers()  # reads the connection events that arrived meanwhile
        return zmq.departed_receivers

    def wait_for_receivers(self, connected: int, *, departed: int = 0, timeout_s: float) -> bool:
        """Wait until exactly ``connected`` receivers are connected and at least ``departed``
        have left (``departed_receivers``); False when ``timeout_s`` passes first.

        After replacing an engine's receiver on this address, wait for
        ``(1, departed=n + 1)``, n read before the old one closed: a refit started sooner can
        lose its BEGIN on the closing connection and wait out one timeout
        (docs/refit-protocol.md, Faults)."""
        return self._zmq().wait_for_receivers(connected, departed=departed, timeout_s=timeout_s)

    def stream_weights_via_ipc_zmq(
        self,
        buffer_size_bytes: int = 0,
        kv_scales: Any = None,
        *,
        timeout_s: float = 120.0,
        keep_staging: bool | None = None,
        one_pass: bool | None = None,
    ) -> dict[str, Any]:
        """One colocated refit; returns the receiver's report (version, tensors, bytes, buckets).

        ``buffer_size_bytes`` is the total for the two ping-pong buffers (each gets half); 0 picks
        a default from free memory (CUDA: at most 1 GiB per buffer) or 64 MiB per buffer (CPU:
        at most a quarter of the free shared memory each). CPU staging files are reserved in
        full when made: a shared-memory folder too small for them raises ``StagingSpaceError``
        naming the size and the fix instead of the SIGBUS a sparse mapping would bring.

        ``keep_staging`` (default: the constructor's, False): by default both staging buffers
        are freed before COMPLETE, so a colocated engine gets that memory back right after the
        refit. True keeps them (and the receiver's mappings of them) for the next
        refit of the same size, which then allocates, shares and opens nothing; free them with
        ``release_staging()`` (and the receiver's ``release_buffers()``) before offloading.

        ``one_pass`` (default: the constructor's, None): None casts every weight straight into
        the memory the receiver registered (an ``HFWeightReceiver`` of an ``nn.Module``
        registers by default), with no staging buffer and no copy on the receiver's side, and
        streams staged where the receiver did not register (a ``load_weights`` callable: the
        vLLM adapter); the receiver's BEGIN answer decides, so it costs no extra round trip.
        True is one-pass only (a receiver that did not register refuses, ``RefitError`` naming
        the fix); False is staged only. The same manifest, size and dtype checks run before
        anything is written either way. ``buffer_size_bytes`` and ``keep_staging`` apply to
        staged refits only.

        Raises:
            ValueError: ``kv_scales`` is given, or a size/timeout is out of range.
            RefitTimeoutError: a wait ran past ``timeout_s`` (the socket is rebuilt: retry later).
            RefitError: the receiver rejected the stream (its reason is in the message).
        """
        check_stream_args(buffer_size_bytes, kv_scales, timeout_s, keep_staging, one_pass)
        stream = self.weight_stream()
        try:
            return self.send(
                stream,
                stream.sources,
                buffer_size_bytes=buffer_size_bytes,
                timeout_s=timeout_s,
                keep_staging=keep_staging,
                one_pass=one_pass,
            )
        finally:
            stream.sources.close()

    def weight_stream(self) -> RefitStream:
        """This refit's weights: the specs and the sources of one walk of the model."""
        return refit_stream(
            self._model_fn(), self.refit_dtype, self._draft_model_fn(), reader=self._state_reader
        )

    def adapter_stream(self) -> RefitStream:
        """This refit's LoRA tensors alone (``adapter_refit.adapter_stream``, in the refit dtype):
        the walk compiled at an earlier refit is reused while the model's adapters are the same
        objects, so a steady-state adapter refit sends the same specs object."""
        from policyworker.shell.refit.adapter_refit import AdapterStreams, adapter_stream

        if self._adapter_streams is None:
            self._adapter_streams = AdapterStreams()
        return adapter_stream(self._model_fn(), dtype=self.refit_dtype, cache=self._adapter_streams)

    def send(
        self,
        stream: RefitStream,
        sources: Iterator[RefitSource],
        *,
        buffer_size_bytes: int,
        timeout_s: float,
        keep_staging: bool | None = None,
        one_pass: bool | None = None,
    ) -> dict[str, Any]:
        """One refit of ``stream``, reading its tensors from ``sources`` (``stream.sources``,
        or an iterator over them whose owner finishes it: a sharded worker's ranks all run the
        gathers), or from ``stream.plain`` when the stream has it (``sources`` is then left
        unread). The arguments were checked by the caller (``check_stream_args``)."""
        mode = self.one_pass if one_pass is None else one_pass
        with torch.no_grad():  # a plain function's context: the caller's grad mode comes back
            if mode is False:
                return self._stream(stream, sources, buffer_size_bytes, timeout_s, keep_staging)
            transport = "cuda" if self.device.type == "cuda" else "shm"

            def staged(exchange: Exchange) -> dict[str, Any]:
                return self._stream(
                    stream, sources, buffer_size_bytes, timeout_s, keep_staging, begun=exchange
                )

            return stream_one_pass(
                self._zmq(),
                self._one_pass_writer,
                stream.specs,
                sources,
                timeout_s=timeout_s,
                transport=transport,
                or_staged=None if mode else staged,
                plain=stream.plain,
            )

    def _stream(
        self,
        stream: RefitStream,
        sources: Iterator[RefitSource],
        buffer_size_bytes: int,
        timeout_s: float,
        keep_staging: bool | None,
        *,
        begun: Exchange | None = None,
    ) -> dict[str, Any]:
        specs = stream.specs
        cuda = self.device.type == "cuda"
        if (
            stream.key != self._stats_key
        ):  # (largest, total) aligned bytes: the default size's inputs
            self._stats_key, self._stats = stream.key, ipc_size_stats(specs)
        if buffer_size_bytes:
            per_buffer = split_ipc_budget(buffer_size_bytes)
        elif cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            per_buffer = default_ipc_buffer_bytes_from(
                *self._stats, cap_bytes=CUDA_DEFAULT_BUFFER_CAP_BYTES, free_bytes=free
            )
        else:  # two buffers in at most half the free shared memory (a receiver maps them too)
            free = shm_free_bytes()
            cap = (
                CPU_DEFAULT_BUFFER_BYTES
                if free is None
                else min(CPU_DEFAULT_BUFFER_BYTES, free // 4)
            )
            per_buffer = default_ipc_buffer_bytes_from(*self._stats, cap_bytes=max(cap, 1))
        if (stream.key, per_buffer) != self._plan_key:  # the plan is reused while nothing changed
            self._plan_key, self._plan = (
                (stream.key, per_buffer),
                plan_ipc_buckets(specs, per_buffer),
            )
        plan = self._plan
        device = self.device

        def make_staging(nbytes: int) -> CudaStaging | ShmStaging:
            return CudaStaging(nbytes, device) if cuda else ShmStaging(nbytes)

        keep = self.keep_staging if keep_staging is None else keep_staging
        return self._zmq().stream(
            specs,
            plan,
            sources,
            make_staging=make_staging,
            buffer_bytes=per_buffer,
            timeout_s=timeout_s,
            transport="cuda" if cuda else "shm",
            keep_staging=keep,
            begun=begun,
            plain=stream.plain,
        )

    def release_staging(self) -> None:
        """Free staging buffers kept by ``keep_staging`` refits (no-op when none are kept)."""
        if self._sender is not None:
            self._sender.release_staging()

    def close(self) -> None:
        """Close the socket and staging for good: later refit calls raise ``RefitError``."""
        with self._creating:
            self._closed = True
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()
        self._one_pass_writer.close()

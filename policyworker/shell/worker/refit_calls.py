"""The worker's weights going out: refit over ZMQ, a collective broadcast or SGLang; noise.

Under a process group every rank takes part: the sharded weights are gathered one tensor at a
time on all ranks and rank 0 alone streams the full tensors to its receiver. Each call reshards
FSDP2 roots first, so the gathers see sharded parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from policyworker.errors import RefitError
from policyworker.functional.dtypes import precision_dtype
from policyworker.shell.worker.state import WorkerState

__all__ = [
    "add_noise",
    "broadcast",
    "init_collective",
    "refit_info",
    "sglang_sender",
    "stream_via_zmq",
    "update_sglang",
    "zmq_sender",
]


def zmq_sender(state: WorkerState) -> Any:
    """The worker's ZMQ refit sender, created on first use."""
    state.require_running("a ZMQ refit")
    if state.refit.sender is None:
        from policyworker.shell.refit.sender import RefitSender

        state.refit.sender = RefitSender(
            lambda: state.model,
            state.dtype,
            rank=state.parallel.rank,
            device=state.device,
            draft_model_fn=lambda: state.draft.model,
        )
    return state.refit.sender


def refit_info(
    state: WorkerState, *, adapter_only: bool = False
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{hf_name: (shape, dtype)} in send order; global (unsharded) shapes on every rank.
    ``adapter_only``: the LoRA tensors alone, under PEFT's names (`adapter_refit`)."""
    state.reshard()
    if adapter_only:
        from policyworker.shell.refit.adapter_refit import adapter_refit_info

        return adapter_refit_info(state.model, dtype=zmq_sender(state).refit_dtype)
    return zmq_sender(state).prepare_refit_info()


def stream_via_zmq(
    state: WorkerState,
    buffer_size_bytes: int,
    kv_scales: Any,
    *,
    timeout_s: float,
    one_pass: bool | None = None,
    adapter_only: bool = False,
) -> dict[str, Any] | None:
    """One colocated refit over ZMQ + CUDA IPC (shared memory on CPU); the receiver's report.

    The arguments are checked once, then every rank walks the weights once (the walk gathers
    a sharded model's tensors) and rank 0 alone sends them. If rank 0's send fails, every rank
    still finishes its walk, so the others are released, and every rank raises (rank 0 with
    the transport's error). ``one_pass`` None: one-pass where the receiver registered its
    memory, else staged. ``adapter_only`` streams the LoRA tensors alone (staged, not
    one-pass: the receiver's PEFT adapter is not a registered arena).
    """
    from policyworker.shell.refit.sender import check_stream_args

    check_stream_args(buffer_size_bytes, kv_scales, timeout_s, one_pass=one_pass)
    if adapter_only and (one_pass is True or not state.lora_module_names):
        msg = (
            f"adapter_only=True (one_pass={one_pass}, LoRA modules: "
            f"{len(state.lora_module_names)}) needs a LoRA worker and one_pass=False; refit the "
            "full weights otherwise"
        )
        raise ValueError(msg)
    state.reshard()
    sender = zmq_sender(state)  # on every rank (it opens no socket until rank 0 sends)
    stream = sender.adapter_stream() if adapter_only else sender.weight_stream()
    sources = _Draining(stream.sources)
    sharded = state.parallel.world_size > 1
    report, failed = None, 0
    try:
        if state.parallel.rank == 0:
            report = sender.send(
                stream,
                sources,
                buffer_size_bytes=buffer_size_bytes,
                timeout_s=timeout_s,
                one_pass=False if adapter_only else one_pass,
            )
    except BaseException:
        failed = 1
        if not sharded:
            stream.sources.close()
            raise
        with contextlib.suppress(Exception), torch.no_grad():  # release the peers' gathers
            sources.drain()
            state.parallel.all_reduce_int(failed, op="max", axis="world")
        raise
    if stream.plain is None:
        with torch.no_grad():
            sources.drain()
    else:  # no gathers to finish: the sender copied the plain tensors, the sources stay unread
        stream.sources.close()
    if sharded and state.parallel.all_reduce_int(failed, op="max", axis="world"):
        msg = (
            f"refit over ZMQ failed on rank 0 (rank {state.parallel.rank} took part in the "
            f"weight gathers only); see rank 0's error, then call "
            f"stream_weights_via_ipc_zmq again on every rank"
        )
        raise RefitError(msg)
    return report


def init_collective(
    state: WorkerState, ip: str, port: int, world_size: int, *, train_world_size: int
) -> None:
    """Join the trainer+engine process group that `broadcast` sends over."""
    from policyworker.shell.refit.collective import init_collective as join

    state.require_running("init_collective")
    state.refit.collective = join(
        ip,
        port,
        world_size,
        train_world_size=train_world_size,
        rank=state.parallel.rank,
        device=state.device,
    )


def broadcast(
    state: WorkerState,
    kv_scales: Any,
    refit_timeout_s: float | None,
    *,
    buffer_size_bytes: int | None,
    num_buffers: int | None,
    use_legacy_packing: bool,
) -> dict[str, Any]:
    """One refit as packed broadcasts over the group of `init_collective`."""
    from policyworker.shell.refit.collective import broadcast_model_weights

    state.require_running("a collective refit")
    state.reshard()
    return broadcast_model_weights(
        state.refit.collective,
        state.model,
        state.dtype,
        draft_model=state.draft.model,
        kv_scales=kv_scales,
        refit_timeout_s=refit_timeout_s,
        buffer_size_bytes=buffer_size_bytes,
        num_buffers=num_buffers,
        use_legacy_packing=use_legacy_packing,
    )


def sglang_sender(state: WorkerState) -> Any:
    """The worker's SGLang colocated sender, created on first use."""
    state.require_running("an SGLang refit")
    if state.refit.sglang is None:
        from policyworker.shell.refit.sglang import SGLangColocatedSender

        state.refit.sglang = SGLangColocatedSender(
            rank=state.parallel.rank, world_size=state.parallel.world_size
        )
    return state.refit.sglang


def update_sglang(
    state: WorkerState,
    *,
    rollout_engines: Any,
    buffer_size_bytes: int,
    target_precision: str,
    sglang_quantization_cfg: Any,
) -> Any:
    """Push the weights, cast to `target_precision`, into colocated SGLang engines."""
    from policyworker.shell.refit.weight_stream import params_generator

    state.reshard()
    named = params_generator(state.model, precision_dtype(target_precision), state.draft.model)
    return sglang_sender(state).update_weights(
        named,
        rollout_engines=rollout_engines,
        buffer_size_bytes=buffer_size_bytes,
        target_precision=target_precision,
        sglang_quantization_cfg=sglang_quantization_cfg,
    )


def add_noise(state: WorkerState) -> None:
    """N(0, 0.01^2) noise on trainable weights; the same full noise tensor on every rank
    (a generator seeded alike), so replicas stay equal and shards stay consistent."""
    state.reshard()
    seed = int(torch.randint(0, 2**30, ())) if state.parallel.rank == 0 else 0
    gen = torch.Generator().manual_seed(state.parallel.all_reduce_int(seed, axis="world"))
    with torch.no_grad():
        for p in state.model.parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.01
            if isinstance(p, DTensor):
                from torch.distributed.tensor import distribute_tensor

                noise = distribute_tensor(
                    noise.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None
                )
            p.add_(noise.to(p.device, p.dtype))
    if state.device.type == "cuda":
        torch.cuda.synchronize()


class _Draining:
    """An iterator that can be run to its end later (`drain`), so every rank of a sharded
    model finishes the same sequence of weight gathers even when the consumer stopped early."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it

    def __iter__(self) -> _Draining:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def drain(self) -> None:
        for _ in self._it:
            pass

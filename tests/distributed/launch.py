"""Run a function on N gloo ranks on CPU (STYLE.md §2.9), with fork + pre-imports.

Spawned ranks re-import torch + transformers (5-12 s per launch on 2 cores); forked ranks
inherit the parent's imports (cpu_env_probe.md §5: about 3 s per 4-rank test). Each rank calls
`torch.set_num_threads(1)` first: after the parent ran a multi-threaded op, a forked child that
keeps the default thread count can hang in OpenMP, and N ranks on 2 cores must not oversubscribe.

A rank that raises tears the job down: `ProcessContext.join` terminates the other ranks and
re-raises the child's traceback in the parent. The process group timeout is bounded (180 s), so a
collective whose peer is gone fails rather than hangs; it is not shorter because a rank of a
2-core runner can be starved for a minute while the previous module's Ray cluster shuts down.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  (pre-import for the forked ranks)
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.multiprocessing as mp
import transformers
from torch.multiprocessing.spawn import ProcessException
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM  # noqa: F401

__all__ = ["run_on_gloo", "run_on_nccl", "RankFailedError", "PROCESS_GROUP_TIMEOUT_S"]

PROCESS_GROUP_TIMEOUT_S = 180.0
assert transformers  # the lazy module must be resolved in the parent for fork to pay off


def _entry(rank: int, fn, world_size: int, init_file: str, timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


class RankFailedError(RuntimeError):
    """One or more ranks raised; the message holds every failed rank's traceback, rank order."""


def run_on_gloo(fn, world_size: int, *args, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks; re-raise any failure.

    When a rank raises, its peers usually fail right after (connection reset); the parent's
    error lists every failed rank's traceback, so the root cause is never hidden by a symptom.
    """
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, os.path.join(tmp, "rdzv"), timeout_s, args),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        try:
            while not context.join():
                pass
        except ProcessException as err:
            traces = []
            for rank, path in enumerate(context.error_files):
                if os.access(path, os.R_OK) and os.path.getsize(path) > 0:
                    with open(path, "rb") as fh:
                        traces.append(f"-- rank {rank}:\n{pickle.load(fh)}")
            raise RankFailedError("\n".join(traces) or str(err)) from err


def _nccl_entry(rank: int, fn, world_size: int, init_file: str, timeout_s: float, args) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=torch.device("cuda", rank),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_on_nccl(fn, world_size: int, *args, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` GPUs (spawned: CUDA does not fork)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _nccl_entry,
            args=(fn, world_size, os.path.join(tmp, "rdzv"), timeout_s, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )

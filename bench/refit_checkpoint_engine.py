"""The checkpoint-engine rows of `bench.refit`: the same fp32 → bf16 refit of the same model into
a receiver in another process, sent through NeMo-RL's checkpoint-engine lifecycle
(``create_checkpoint_engine`` → ``prepare`` → ``init_policy_process_group`` → ``send_weights``,
the rollout side a ``CheckpointEngineRollout`` in the child), at the per-buffer size our staged
refit picked.

- ``checkpoint-engine ipc``: the colocated backend (our ZMQ transport; CUDA IPC on a GPU,
  /dev/shm on CPU) with its defaults: the rollout rank's module registers its memory, so the
  refit is one-pass (cast straight into the rollout's arena, as our ``default`` row); the row's
  ``settings`` name the mode the engine took (``last_mode``);
- ``checkpoint-engine collective``: the packed broadcast (gloo on CPU). Not on one GPU: NCCL
  refuses two ranks on one device, so it runs only with ``--small`` (the 2-GPU NCCL path is
  tests/gpu/test_checkpoint_engine_gpu.py's);
- ``checkpoint-engine nixl``: our NIXL backend with its defaults (each bucket's tensors WRITten
  straight into the rollout module's registered arena: one-pass, DRAM on CPU, VRAM on a GPU),
  where the ``nixl`` package imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.refit_baselines import REPEATS, build_module, timed
from policyworker.shell.refit import RefitSender
from policyworker.shell.refit.checkpoint_engine import (
    CheckpointEngineRollout,
    create_checkpoint_engine,
    known_backends,
)

ROWS = {
    "ipc": "checkpoint-engine ipc",
    "collective": "checkpoint-engine collective",
    "nixl": "checkpoint-engine nixl",
}
TIMEOUT_S = 300.0


def engine_kwargs(backend: str, device: str) -> dict[str, Any]:
    if device == "cuda":  # the staging's device by index: the child opens the same one
        device = f"cuda:{torch.cuda.current_device()}"
    base: dict[str, Any] = {"device": device, "timeout_s": TIMEOUT_S}
    return {**base, "host": "127.0.0.1"} if backend == "collective" else base


def backends_for(device: str) -> list[str]:
    """The backends one device can measure (NCCL needs a GPU per rank; nixl its package)."""
    nixl = ["nixl"] if "nixl" in known_backends() else []
    return ["ipc", *nixl] if device.startswith("cuda") else ["ipc", "collective", *nixl]


def checkpoint_engine_times(
    module: str,
    sender: RefitSender,
    shapes: Mapping[str, tuple[int, ...]],
    info: Mapping[str, tuple[torch.Size, torch.dtype]],
    *,
    device: str,
    per_buffer: int,
) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """Each backend's ``timed`` refits (s), by row name, and each row's settings (the backend,
    its bucket size and options, and the mode it took). ``module`` runs the receiver
    (``python -m module --role ce-receiver``)."""
    cuda = device.startswith("cuda")
    stream = sender.weight_stream
    refit_info = dict(info)
    out, settings = {}, {}
    for backend in backends_for(device):
        policy = create_checkpoint_engine(
            backend, bucket_size_bytes=per_buffer, engine_kwargs=engine_kwargs(backend, device)
        )
        loop = asyncio.new_event_loop()
        try:
            receiver = ReceiverChild(
                module, backend, shapes, info, policy.prepare(), device, per_buffer
            )
            with receiver as metadata:
                policy.init_policy_process_group(
                    worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
                )

                def refit(policy: Any = policy, loop: Any = loop) -> None:
                    weights = ((s.name, s.tensor) for s in stream().sources)
                    with torch.no_grad():
                        loop.run_until_complete(policy.send_weights(weights, refit_info=refit_info))

                out[ROWS[backend]] = timed(refit, cuda)
                settings[ROWS[backend]] = {
                    "backend": backend,
                    "bucket_size_bytes": per_buffer,
                    "engine_kwargs": engine_kwargs(backend, device),
                    # ipc, nixl: "one-pass", or "staged" where the rollout side did not register
                    "mode": getattr(policy, "last_mode", None) or "packed broadcast",
                }
        finally:
            policy.finalize()
            loop.close()
    return out, settings


class ReceiverChild:
    """The receiving child of one backend: started with the policy's metadata, it prints its
    own; the context's value is the full metadata list. It serves ``REPEATS + 1`` refits."""

    def __init__(
        self,
        module: str,
        backend: str,
        shapes: Mapping[str, tuple[int, ...]],
        info: Mapping[str, tuple[torch.Size, torch.dtype]],
        policy_meta: Any,
        device: str,
        per_buffer: int,
    ) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        spec = Path(self.tmp.name) / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "device": device,
                    "shapes": shapes,
                    "refit_info": {
                        n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()
                    },
                    "backend": backend,
                    "bucket_size_bytes": per_buffer,
                    "engine_kwargs": engine_kwargs(backend, device),
                    "policy_meta": policy_meta,
                    "num_refits": REPEATS + 1,
                }
            )
        )
        self.policy_meta = policy_meta
        self.args = [sys.executable, "-m", module, "--role", "ce-receiver", "--spec", str(spec)]

    def __enter__(self) -> list[Any]:
        self.child = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.child.stdout is not None
        line = self.child.stdout.readline().strip()
        for _ in range(100):  # a library's log lines may come first
            if line.startswith("META ") or not line:
                break
            line = self.child.stdout.readline().strip()
        if not line.startswith("META "):
            self.child.kill()
            raise RuntimeError(f"checkpoint-engine receiver did not start: {line!r}")
        return [self.policy_meta, json.loads(line.removeprefix("META "))]

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.child.wait(timeout=TIMEOUT_S)
        finally:
            if self.child.poll() is None:
                self.child.kill()
            self.tmp.cleanup()


def run_ce_receiver(args: argparse.Namespace) -> None:
    """The rollout rank: a bf16 module behind ``CheckpointEngineRollout``."""
    from policyworker.functional.wire.codec import DTYPES_BY_NAME

    torch.set_num_threads(1)
    spec = json.loads(Path(args.spec).read_text())
    device = spec["device"]
    target: nn.Module = build_module(
        {n: tuple(s) for n, s in spec["shapes"].items()},
        dtype=torch.bfloat16,
        device=device,
        random=False,
    )
    info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in spec["refit_info"].items()}
    rollout = CheckpointEngineRollout(target, refit_info=info, device=device)
    rollout.init_checkpoint_engine(
        spec["backend"], spec["bucket_size_bytes"], spec["engine_kwargs"]
    )
    mine = rollout.prepare_checkpoint_engine()
    print("META " + json.dumps(mine), flush=True)
    rollout.init_checkpoint_engine_process_group(0, 1, 1, [spec["policy_meta"], mine])
    for _ in range(spec["num_refits"]):
        rollout.update_weights_from_checkpoint_engine()
    rollout.finalize_checkpoint_engine()

"""The parts of NeMo-RL's policy-worker surface that its drivers call beside the work itself.

`NeMoRLWorkerSurface` is a mixin of `PolicyWorker` (it reads `self.state`): the methods of
NeMo-RL's `AbstractPolicyWorker` that drivers call (device and memory reports, node ip), and
the private hooks of its DTensor v2 worker that mixins and extensions call (`_get_replica_group`,
`_local_coords`, `_autocast_context`, `_checkpoint_engine_params`). On a CPU-only process the
device reports describe the CPU (NeMo-RL's versions need CUDA and NVML).

`split_constructor_kwargs` reads the keyword arguments NeMo-RL's `Policy` passes to a worker.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from policyworker.shell.model import hf_model as model_lib

__all__ = ["NEMO_RL_WORKER_KWARGS", "NeMoRLWorkerSurface", "split_constructor_kwargs"]

log = logging.getLogger("policyworker")

_MIB = 1024**2
# Keyword arguments NeMo-RL's Policy passes to its workers, with what this worker does with them.
NEMO_RL_WORKER_KWARGS: Mapping[str, str] = {
    "worker_sharding_annotations": "not used: the process group gives the layout",
    "pre_init_communication_queue": "not used: no pre-init handshake is needed",
    "skip_weight_load": "not used: weights are always loaded from model_name / weights_path",
    "tokenizer": "used as the worker's tokenizer instead of loading one",
    "processor": "must be None: multimodal processors are not supported",
}


# PolicyWorker's own parameters, offered as corrections of a misspelled keyword.
_NAMED_PARAMETERS = ("weights_path", "optimizer_path", "init_optimizer", "init_reference_model")


def split_constructor_kwargs(kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """(parallel, tokenizer) from a worker constructor's `**kwargs`; NeMo-RL's keys accepted.

    Raises:
        ValueError: a key neither NeMo-RL nor this worker passes, or a non-None `processor`;
            raised before anything is built.
    """
    unknown = sorted(set(kwargs) - set(NEMO_RL_WORKER_KWARGS) - {"parallel"})
    if unknown:
        known = [*_NAMED_PARAMETERS, "parallel", *NEMO_RL_WORKER_KWARGS]
        hints = [
            f"{k!r} -> did you mean {close[0]!r}?"
            for k in unknown
            if (close := difflib.get_close_matches(k, known, n=1, cutoff=0.75))
        ]
        msg = (
            f"unexpected PolicyWorker keyword arguments {unknown}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f"; accepted: {list(_NAMED_PARAMETERS)}, parallel and NeMo-RL's "
            f"{sorted(NEMO_RL_WORKER_KWARGS)}"
        )
        raise ValueError(msg)
    if kwargs.get("processor") is not None:
        msg = (
            f"processor={type(kwargs['processor']).__name__} is not supported (text-only "
            "worker); pass processor=None"
        )
        raise ValueError(msg)
    unused = sorted(
        k
        for k in kwargs
        if k in NEMO_RL_WORKER_KWARGS and NEMO_RL_WORKER_KWARGS[k].startswith("not used")
    )
    if unused:
        log.info("accepted, not used: PolicyWorker keyword arguments %s", ", ".join(unused))
    return kwargs.get("parallel"), kwargs.get("tokenizer")


class NeMoRLWorkerSurface:
    """NeMo-RL's base-worker methods and DTensor-worker hooks, on `self.state`."""

    state: Any

    # -- AbstractPolicyWorker ------------------------------------------------------------------

    def get_gpu_info(self) -> dict[str, Any]:
        """NeMo-RL's `get_gpu_info` keys: ranks, device ids and name, memory in MB, and one
        trainable parameter's device/shape/dtype (to verify placement)."""
        device = self.state.device
        cuda = device.type == "cuda"
        index = torch.cuda.current_device() if cuda else -1
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        global_id = index
        if cuda and visible and local_rank < len(visible.split(",")):
            entry = visible.split(",")[local_rank]
            global_id = int(entry) if entry.isdigit() else index
        return {
            "rank": self.state.parallel.rank,
            "world_size": self.state.parallel.world_size,
            "local_rank": local_rank,
            "local_device_id": index,
            "global_device_id": global_id,
            "device_count": torch.cuda.device_count() if cuda else 0,
            "device_name": torch.cuda.get_device_name(index) if cuda else "cpu",
            "memory_allocated_mb": torch.cuda.memory_allocated(index) / _MIB if cuda else 0.0,
            "memory_reserved_mb": torch.cuda.memory_reserved(index) / _MIB if cuda else 0.0,
            "peak_memory_allocated_mb": torch.cuda.max_memory_allocated() / _MIB if cuda else 0.0,
            "peak_memory_reserved_mb": torch.cuda.max_memory_reserved() / _MIB if cuda else 0.0,
            "parameter_sample": _one_trainable_parameter(self.state.model),
            "env_vars": {
                k: v
                for k, v in os.environ.items()
                if k.startswith("CUDA") or k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")
            },
        }

    def report_device_id(self) -> str:
        """`GPU-<uuid>` of the current CUDA device (what NVML reports); `CPU-<host>-<pid>` on a
        CPU-only process (a process-unique id: there is no device UUID)."""
        if self.state.device.type == "cuda":
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            return f"GPU-{props.uuid}"
        return f"CPU-{socket.gethostname()}-{os.getpid()}"

    def get_free_memory_bytes(self) -> int:
        """Free bytes of the current CUDA device, or the host's available memory on CPU."""
        if self.state.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(torch.cuda.current_device())
            return int(free)
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))

    def reset_peak_memory_stats(self) -> None:
        """Reset CUDA's peak-memory counters (a CPU-only process keeps none)."""
        if self.state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def report_node_ip_and_gpu_id(self) -> tuple[str, int]:
        """(this node's IP address, the CUDA device index; -1 on a CPU-only process)."""
        ip = socket.gethostbyname(socket.gethostname())
        return ip, torch.cuda.current_device() if self.state.device.type == "cuda" else -1

    # -- DTensor v2 worker hooks ---------------------------------------------------------------

    def _get_replica_group(self) -> Any:
        """The (cp, tp) process group: the ranks that hold the same data (None when alone)."""
        return self.state.parallel.replica_group()

    def _local_coords(self) -> dict[str, int]:
        """This rank's `tensor_parallel` and `context_parallel` coordinates (NeMo-RL's keys)."""
        coords = self.state.parallel.local_coords()
        return {
            "tensor_parallel": coords["tensor_parallel"],
            "context_parallel": coords["context_parallel"],
        }

    def _autocast_context(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast every forward of this worker runs under (`precision` on its device)."""
        return model_lib.autocast_context(self.state.device, self.state.dtype)

    def _checkpoint_engine_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(hf_name, full tensor)` in refit order and the compute dtype, LoRA merged; a
        collective generator under a process group (every rank must drain it)."""
        from policyworker.shell.refit.weight_stream import params_generator

        self.state.reshard()
        yield from params_generator(self.state.model, self.state.dtype, self.state.draft.model)


def _one_trainable_parameter(model: torch.nn.Module) -> dict[str, Any]:
    for name, param in model.named_parameters():
        if param.requires_grad:
            return {
                name: {
                    "device": str(param.device),
                    "shape": list(param.shape),
                    "dtype": str(param.dtype),
                }
            }
    return {}

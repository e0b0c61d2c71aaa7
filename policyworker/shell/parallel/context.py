"""Process group and parallel layout of one worker; collectives that short-circuit at size 1.

API.md §7 "Process group": use the default group if initialised; else initialise one when the
torchrun variables say WORLD_SIZE > 1; else run as a single process with no group at all.

Every group this module creates (the mesh axes, the flattened dp_cp / cp_tp axes and a private
world group) carries `timeout_s`, so every collective the worker issues through them (its own
all-reduces, and the DTensor / FSDP2 collectives that run on the mesh) fails after that long
instead of hanging when a peer died.

Context parallelism needs torch's context-parallel attention, which has no CPU kernel
(reference/cpu_env_probe.md §3), so `from_environment` rejects cp_size > 1 on CPU.
"""

from __future__ import annotations

import datetime
import os

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import ProcessGroup, _set_pg_timeout

__all__ = ["ParallelContext", "DEFAULT_COLLECTIVE_TIMEOUT_S"]

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@attrs.define(kw_only=True)
class ParallelContext:
    """Sizes, coordinates and process groups of this rank; size-1 axes need no group.

    Rank layout is row-major over (dp, cp, tp): tp varies fastest.
    """

    world_size: int
    rank: int
    dp_size: int
    cp_size: int
    tp_size: int
    device: torch.device
    mesh: DeviceMesh | None = None  # over ("dp", "cp", "tp") when a process group exists
    groups: dict[str, ProcessGroup] = attrs.field(factory=dict)  # axis name -> group
    owns_process_group: bool = False
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.cp_size * self.tp_size)

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @classmethod
    def single(cls, device: torch.device) -> ParallelContext:
        """A one-process context: every collective is the identity."""
        return cls(world_size=1, rank=0, dp_size=1, cp_size=1, tp_size=1, device=device)

    @classmethod
    def from_environment(
        cls,
        *,
        tp_size: int = 1,
        cp_size: int = 1,
        device: torch.device | None = None,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ) -> ParallelContext:
        """Join (or create, under torchrun) the default process group and build the mesh."""
        if device is None:
            device = _default_device()
        if cp_size > 1 and device.type != "cuda":
            msg = (
                f"context_parallel_size={cp_size} needs CUDA: torch has no CPU kernel for "
                f"context-parallel attention (device is {device.type!r}); set "
                f"context_parallel_size to 1 on CPU"
            )
            raise ValueError(msg)
        owns = False
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
            owns = True
        if not dist.is_initialized():
            if tp_size * cp_size != 1:
                msg = (
                    f"tensor_parallel_size={tp_size} and context_parallel_size={cp_size} need "
                    f"{tp_size * cp_size} processes but this is a single process; launch with "
                    f"torchrun --nproc-per-node {tp_size * cp_size} or set both sizes to 1"
                )
                raise ValueError(msg)
            return cls.single(device)
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if world_size % (tp_size * cp_size) != 0:
            msg = (
                f"world size {world_size} is not divisible by tensor_parallel_size * "
                f"context_parallel_size = {tp_size} * {cp_size}; choose sizes whose product "
                f"divides the number of processes"
            )
            raise ValueError(msg)
        dp_size = world_size // (tp_size * cp_size)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type, (dp_size, cp_size, tp_size), mesh_dim_names=("dp", "cp", "tp")
        )
        groups = {axis: mesh.get_group(axis) for axis in ("dp", "cp", "tp")}
        groups["dp_cp"] = mesh["dp", "cp"]._flatten("dp_cp").get_group()
        groups["cp_tp"] = mesh["cp", "tp"]._flatten("cp_tp").get_group()
        timeout = datetime.timedelta(seconds=timeout_s)
        world = dist.new_group(timeout=timeout)
        if not isinstance(world, ProcessGroup):  # this rank is in the new group, so never None
            msg = f"torch.distributed.new_group returned {world!r} for the world group"
            raise RuntimeError(msg)
        groups["world"] = world
        for group in {id(g): g for g in groups.values()}.values():
            if group is not dist.group.WORLD or owns:
                _set_pg_timeout(timeout, group)
        return cls(
            world_size=world_size,
            rank=rank,
            dp_size=dp_size,
            cp_size=cp_size,
            tp_size=tp_size,
            device=device,
            mesh=mesh,
            groups=groups,
            owns_process_group=owns,
            timeout_s=timeout_s,
        )

    def axis_size(self, axis: str) -> int:
        sizes = {
            "dp": self.dp_size,
            "cp": self.cp_size,
            "tp": self.tp_size,
            "dp_cp": self.dp_size * self.cp_size,
            "cp_tp": self.cp_size * self.tp_size,
            "world": self.world_size,
        }
        return sizes[axis]

    def all_reduce(
        self, tensor: torch.Tensor, *, op: str = "sum", axis: str = "dp"
    ) -> torch.Tensor:
        """Reduce `tensor` in place over `axis` and return it (identity for a size-1 axis)."""
        if self.axis_size(axis) == 1:
            return tensor
        dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.groups[axis])
        return tensor

    def all_reduce_int(self, value: int, *, op: str = "sum", axis: str = "world") -> int:
        """Reduce a Python int over `axis` (on CPU for gloo, else on this rank's device)."""
        if self.axis_size(axis) == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self._collective_device())
        self.all_reduce(tensor, op=op, axis=axis)
        return int(tensor.item())

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier(group=self.groups["world"])

    def replica_group(self) -> ProcessGroup | None:
        """The (cp, tp) group: the ranks that hold the same data shard (None when alone)."""
        return self.groups.get("cp_tp")

    def local_coords(self) -> dict[str, int]:
        """This rank's coordinates: data_parallel, context_parallel, tensor_parallel."""
        return {
            "data_parallel": self.dp_rank,
            "context_parallel": self.cp_rank,
            "tensor_parallel": self.tp_rank,
        }

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards parameters over: dp, or dp x cp flattened when cp > 1."""
        if self.mesh is None:
            msg = "fsdp_mesh() needs a process group; this ParallelContext is a single process"
            raise ValueError(msg)
        return self.mesh["dp_cp"] if self.cp_size > 1 else self.mesh["dp"]

    def shutdown(self) -> None:
        """Destroy the process group only if this context created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")

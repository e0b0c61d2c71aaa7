"""The Ray side of a worker group: the version gate, the placement group, the actor of one rank.

`import_ray` refuses a missing or unsupported Ray by name; `make_placement_group` waits for its
bundles within a timeout; `PolicyWorkerActor` builds one PolicyWorker inside a Ray actor from the
torch.distributed environment the group hands it (`policyworker.shell.ray.group`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from attrs import field, frozen
from attrs.validators import ge, gt, in_, optional

from policyworker.errors import WorkerGroupTimeoutError
from policyworker.functional.worker_group import version_in_range

if TYPE_CHECKING:
    from policyworker.config import PolicyConfig
    from policyworker.shell.worker.policy_worker import PolicyWorker

__all__ = [
    "RAY_SUPPORTED",
    "STRATEGIES",
    "PolicyWorkerActor",
    "WorkerGroupOptions",
    "import_ray",
    "make_placement_group",
]

RAY_MINIMUM, RAY_BELOW, RAY_TESTED = (2, 40), (3,), "2.60.0"
RAY_SUPPORTED = f">={'.'.join(map(str, RAY_MINIMUM))},<{RAY_BELOW[0]} (tested with {RAY_TESTED})"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


def import_ray() -> Any:
    """`import ray`, refusing a missing or unsupported Ray by name."""
    try:
        import ray
    except ImportError as err:
        msg = (
            "policyworker.shell.ray needs Ray, which is not installed; "
            "pip install 'policyworker[ray]'"
        )
        raise ImportError(msg) from err
    if not version_in_range(ray.__version__, minimum=RAY_MINIMUM, below=RAY_BELOW):
        msg = (
            f"ray {ray.__version__} is not supported by policyworker.shell.ray (it needs ray "
            f"{RAY_SUPPORTED}); pip install 'policyworker[ray]'"
        )
        raise ImportError(msg)
    return ray


@frozen(kw_only=True)
class WorkerGroupOptions:
    """Placement, resources and timeouts of a RayWorkerGroup."""

    num_workers: int = field(validator=ge(1))
    strategy: PlacementStrategy = field(default="PACK", validator=in_(STRATEGIES))
    cpus_per_worker: float = field(default=1.0, validator=gt(0))
    gpus_per_worker: float | None = field(default=None, validator=optional(ge(0)))  # None: auto
    torch_threads: int | None = field(default=None, validator=optional(ge(1)))  # None: the CPUs
    timeout_s: float = field(default=600.0, validator=gt(0))  # the start and every call
    collective_timeout_s: float = field(default=600.0, validator=gt(0))


def make_placement_group(
    num_bundles: int,
    bundle: Mapping[str, float],
    *,
    strategy: str = "PACK",
    timeout_s: float = 600.0,
) -> Any:
    """A ready placement group of `num_bundles` copies of `bundle`; removed again if it is not
    ready within `timeout_s` (the error names the request and what the cluster has)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    if strategy not in STRATEGIES:
        msg = f"strategy={strategy!r} must be one of {list(STRATEGIES)}"
        raise ValueError(msg)
    group = placement_group([dict(bundle)] * num_bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        msg = (
            f"a placement group of {num_bundles} x {dict(bundle)} ({strategy}) was not ready "
            f"within {timeout_s} s; the cluster has {ray.available_resources()} available: "
            f"free resources, ask for fewer workers or less per worker, or relax the strategy"
        )
        raise WorkerGroupTimeoutError(msg, method="placement_group")
    return group


class PolicyWorkerActor:
    """One rank of a RayWorkerGroup: a PolicyWorker built inside a Ray actor process."""

    def __init__(self, torch_threads: int) -> None:
        import torch

        torch.set_num_threads(torch_threads)  # N workers on one node must not oversubscribe it
        self._worker: PolicyWorker | None = None

    @property
    def worker(self) -> PolicyWorker:
        """This rank's worker, once `start` built it."""
        if self._worker is None:
            msg = "this actor's PolicyWorker is not built yet: call start() first"
            raise RuntimeError(msg)
        return self._worker

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def start(
        self,
        env: Mapping[str, str],
        config: PolicyConfig | Mapping[str, Any],
        worker_kwargs: Mapping[str, Any],
        *,
        use_gpu: bool,
        collective_timeout_s: float,
    ) -> dict[str, int]:
        os.environ.update(env)  # before the process group reads them
        import torch

        from policyworker.config import load_config
        from policyworker.shell.parallel.context import ParallelContext
        from policyworker.shell.worker.policy_worker import PolicyWorker

        cfg = load_config(config) if isinstance(config, Mapping) else config
        device = torch.device("cpu")
        if use_gpu:
            torch.cuda.set_device(0)
            device = torch.device("cuda", 0)
        parallel = ParallelContext.from_environment(
            tp_size=cfg.dtensor_cfg.tensor_parallel_size,
            cp_size=cfg.dtensor_cfg.context_parallel_size,
            device=device,
            timeout_s=collective_timeout_s,
        )
        self._worker = PolicyWorker(cfg, parallel=parallel, **worker_kwargs)
        return parallel.local_coords()

    def vocab_rows(self) -> int:
        """Rows of the model's input embedding: the driver checks token ids against it."""
        return self.worker.state.vocab_rows

    def call(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

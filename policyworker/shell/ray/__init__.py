"""PolicyWorker as a group of Ray actors (extra "ray"); see `group.py` for the design.

actor.py         the version gate, placement groups, the actor that holds one rank's worker
group.py         RayWorkerGroup: start, sharded / every-rank / rank-0 calls, shutdown
calls.py         a call's results in rank order; failure by rank; when the group is unusable
sharding.py      the rows of a call split over the dp ranks, and the way back
shard_checks.py  every shard checked on the driver by the worker's batch checks, before dispatch
"""

from policyworker.shell.ray.actor import (
    RAY_SUPPORTED,
    WorkerGroupOptions,
    import_ray,
    make_placement_group,
)
from policyworker.shell.ray.group import RayWorkerGroup

__all__ = [
    "RAY_SUPPORTED",
    "RayWorkerGroup",
    "WorkerGroupOptions",
    "import_ray",
    "make_placement_group",
]

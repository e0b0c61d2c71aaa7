"""PolicyWorker as a group of Ray actors (extra "ray"); see `group.py` for the design.

actor.py         the version gate, placement groups, the actor that holds one rank's worker
group.py         RayWorkerGroup: start, sharded / every-rank / rank-0 calls, shutdown
calls.py         a call's results in rank order; failure by rank; when the group is unusable
sharding.py      the rows of a call split over the dp ranks, and the way back
shard_checks.py  every shard checked on the driver by the worker's batch checks, before dispatch
data_plane.py    presharded group calls: each rank fetches its rows from the data plane by receipt
"""

from policyworker._lazy import lazy_exports

_ACTOR = "policyworker.shell.ray.actor"
_DATA_PLANE = "policyworker.shell.ray.data_plane"
# Resolved on first use: importing one of the package's modules runs no other through the face.
__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "RAY_SUPPORTED": _ACTOR,
        "WorkerGroupOptions": _ACTOR,
        "import_ray": _ACTOR,
        "make_placement_group": _ACTOR,
        "RayWorkerGroup": "policyworker.shell.ray.group",
        "split_over_dp": "policyworker.shell.ray.sharding",
        "rank_receipts": _DATA_PLANE,
        "read_fields": _DATA_PLANE,
        "setup_data_plane": _DATA_PLANE,
        "train_presharded": _DATA_PLANE,
        "get_logprobs_presharded": _DATA_PLANE,
        "get_reference_policy_logprobs_presharded": _DATA_PLANE,
        "begin_train_step_presharded": _DATA_PLANE,
        "train_microbatch_presharded": _DATA_PLANE,
        "finish_train_step_presharded": _DATA_PLANE,
        "abort_train_step_presharded": _DATA_PLANE,
    },
)

"""Checkpoint-engine refit: NeMo-RL's lifecycle over pluggable backends.

    base.py        CheckpointEngine: prepare / init_policy_process_group /
                   init_rollout_process_group / send_weights / receive_weights / finalize
    registry.py    backends by name (collective, ipc, nixl where it imports, "module:Class")
    collective.py  our packed broadcast over a trainer + rollout group (gloo / NCCL)
    ipc.py         colocated: our ZMQ transport, CUDA IPC / shared-memory staging
    nixl.py        NIXL one-sided WRITEs into the rollout's weight arena or registered slots
    nixl_link.py   the NIXL agent: lazy import + version check, notifications, bounded waits
    rollout.py     CheckpointEngineRollout: the rollout rank hosting a receiver target

The policy side is ``PolicyWorker.checkpoint_engine_rpc``
(``shell/worker/checkpoint_engine_calls``);
docs/checkpoint-engine.md walks the whole lifecycle.
"""

from policyworker.shell.refit.checkpoint_engine.base import CheckpointEngine
from policyworker.shell.refit.checkpoint_engine.registry import (
    BACKENDS,
    create_checkpoint_engine,
    known_backends,
)
from policyworker.shell.refit.checkpoint_engine.rollout import CheckpointEngineRollout

__all__ = [
    "BACKENDS",
    "CheckpointEngine",
    "CheckpointEngineRollout",
    "create_checkpoint_engine",
    "known_backends",
]

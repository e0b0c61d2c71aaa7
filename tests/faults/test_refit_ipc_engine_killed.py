"""A policy process of the ipc checkpoint engine SIGKILLed midway through a one-pass refit: the
rollout rank's wait for COMPLETE times out, and it is left as the one-pass rules say (in place:
stale, the dead sender's writes visible; atomic: the last version live), then a new policy engine
refits it (NeMo-RL's recovery: finalize, set the engine up again)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
import torch

from policyworker.errors import RefitTimeoutError
from policyworker.shell.refit.checkpoint_engine import CheckpointEngineRollout
from policyworker.shell.refit.one_pass import sender as one_pass_sender
from tests.shell.refit.test_checkpoint_engine_ipc_one_pass import (
    _cast,
    _close,
    _equal,
    _info,
    _join,
    _Model,
    _policy,
    _refit,
    _state,
    _weights,
)

pytestmark = pytest.mark.faults

KILLED_TIMEOUT_S = 3.0


def _policy_process(conn, count):
    """A policy rank in its own process: one refit lands, then it is SIGKILLed after ``count``
    tensors of the next (no ABORT: the trainer dies mid-write)."""
    torch.set_num_threads(1)
    one_pass_sender._GROUP_TENSORS = 1  # each tensor lands at once (this process's own copy)
    policy = _policy(timeout_s=KILLED_TIMEOUT_S)
    conn.send(policy.prepare())
    policy.init_policy_process_group(
        worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=conn.recv()
    )
    model = _Model(1)
    asyncio.run(policy.send_weights(_weights(model), refit_info=_info(model)))
    with torch.no_grad():
        model.big.mul_(2.0)

    def dying():
        pairs = list(model.state_dict().items())
        yield from pairs[:count]
        os.kill(os.getpid(), signal.SIGKILL)
        yield from pairs[count:]

    asyncio.run(policy.send_weights(dying(), refit_info=_info(model)))


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_policy_process_killed_midway_leaves_the_rollout_as_the_one_pass_rules_say(atomic):
    """The rollout rank's wait for COMPLETE times out; its version is unchanged, in place it is
    stale (the dead sender wrote some weights), atomic its live weights are the last version;
    a new policy engine then refits it (NeMo-RL's recovery: finalize, set up again)."""
    model, target = _Model(1), _Model(2, torch.bfloat16)
    info = _info(model)
    rollout = CheckpointEngineRollout(target, refit_info=info, atomic=atomic)
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_policy_process, args=(child_conn, 3), daemon=True)
    child.start()
    policy = None
    try:
        assert conn.poll(120), "the policy process did not start"
        conn.send(_join(conn.recv(), [rollout], timeout_s=KILLED_TIMEOUT_S))
        assert rollout.receive_weights().version == 1
        first = _state(target)
        assert _equal(first, _cast(model))
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match="no message in phase 'bucket or complete'"):
            rollout.receive_weights()
        assert time.monotonic() - started < KILLED_TIMEOUT_S + 10
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        assert rollout.receiver.version == 1 and rollout.receiver.stale == (not atomic)
        # in place the dead sender's writes show (big doubled); atomic the live arena is intact
        assert _equal(_state(target), first) == atomic
        rollout.finalize_checkpoint_engine()
        policy = _policy()
        _join(policy.prepare(), [rollout], policy=policy)
        report, (got,) = _refit(policy, [rollout], _weights(model), info)
        assert report["version"] == 2 and policy.last_mode == "one-pass", report
        assert not rollout.receiver.stale and _equal(_state(target), _cast(model))
    finally:
        if child.is_alive():
            child.kill()
        if policy is not None:
            policy.finalize()
        _close([rollout])

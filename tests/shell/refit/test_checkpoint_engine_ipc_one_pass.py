"""The ipc checkpoint engine's one-pass refit on CPU: the rollout rank's module registers a
/dev/shm arena at its first refit and the policy rank casts ``send_weights``' stream straight into
it. Both ends run in this process (the rollout side on a thread), so these tests drive the real
engine, receiver and protocol code; tests/faults/test_refit_ipc_engine_killed.py kills a policy
process midway."""

import asyncio
import contextlib
import re
import threading

import pytest
import torch
from torch import nn

from policyworker.errors import RefitError
from policyworker.functional.wire.codec import RefitRejectedError
from policyworker.shell.refit.checkpoint_engine import (
    CheckpointEngineRollout,
    create_checkpoint_engine,
)
from policyworker.shell.refit.one_pass import sender as one_pass_sender

BUCKET = 4096
TIMEOUT_S = 30.0


class _Model(nn.Module):
    """Float weights (sent as bf16, cast from the fp32 masters), a large one, and an int buffer."""

    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.small = nn.Parameter(torch.randn(128, generator=g).to(dtype))
        self.big = nn.Parameter(torch.randn(96, 64, generator=g).to(dtype))
        self.norm = nn.Parameter(torch.randn(64, generator=g).to(dtype))
        self.steps = nn.Buffer(torch.arange(100, 164, dtype=torch.int64) + seed)


def _info(model, dtype=torch.bfloat16):
    return {
        name: (tensor.shape, dtype if tensor.is_floating_point() else tensor.dtype)
        for name, tensor in model.state_dict().items()
    }


def _weights(model):
    return iter(list(model.state_dict().items()))


def _cast(model):
    return {
        name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor.clone()
        for name, tensor in model.state_dict().items()
    }


def _state(module):
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _engine_kwargs(**options):
    return {"device": "cpu", "timeout_s": TIMEOUT_S, **options}


def _join(policy_meta, rollouts, *, policy=None, peers=1, **options):
    """Connect each rollout (rollout rank i) to policy rank 0, and the policy engine if it runs
    here; the metadata list."""
    kwargs = _engine_kwargs(peers_per_rank=peers, **options)
    for rollout in rollouts:
        rollout.init_checkpoint_engine("ipc", BUCKET, kwargs)
    metadata = [policy_meta, *(r.prepare_checkpoint_engine() for r in rollouts)]
    for i, rollout in enumerate(rollouts):
        rollout.init_checkpoint_engine_process_group(i, 1, len(rollouts), metadata)
    if policy is not None:
        policy.init_policy_process_group(
            worker_rank=0, train_world_size=1, rollout_world_size=len(rollouts), metadata=metadata
        )
    return metadata


def _policy(peers=1, **options):
    kwargs = _engine_kwargs(peers_per_rank=peers, **options)
    return create_checkpoint_engine("ipc", bucket_size_bytes=BUCKET, engine_kwargs=kwargs)


def _close(rollouts):
    for rollout in rollouts:
        rollout.finalize_checkpoint_engine()
        if rollout.receiver.arena is not None:
            rollout.receiver.arena.close()


@contextlib.contextmanager
def _connected(targets, infos, *, atomic=False, peers=1, **options):
    """A policy engine (rank 0 of 1) and one ``CheckpointEngineRollout`` per target."""
    policy = _policy(peers, **options)
    rollouts = [
        CheckpointEngineRollout(t, refit_info=i, atomic=atomic)
        for t, i in zip(targets, infos, strict=True)
    ]
    try:
        _join(policy.prepare(), rollouts, policy=policy, peers=peers, **options)
        yield policy, rollouts
    finally:
        policy.finalize()
        _close(rollouts)


def _refit(policy, rollouts, weights, info):
    """One refit, every rollout receiving on a thread: (the policy's report or the exception
    it raised, each rollout's report or exception)."""
    got = [None] * len(rollouts)

    def serve(i):
        try:
            got[i] = rollouts[i].receive_weights()
        except Exception as exc:  # surfaced by the test
            got[i] = exc

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(rollouts))]
    for thread in threads:
        thread.start()
    try:
        sent = asyncio.run(policy.send_weights(weights, refit_info=info))
    except Exception as exc:
        sent = exc
    for thread in threads:
        thread.join(TIMEOUT_S)
    return sent, got


def _failing_after(model, count):
    pairs = list(model.state_dict().items())

    def weights():
        yield from pairs[:count]
        raise OSError("disk on fire")

    return weights()


def test_one_pass_refit_writes_the_trainers_cast_into_the_registered_arena():
    model, target = _Model(1), _Model(2, torch.bfloat16)
    info = _info(model)
    with _connected([target], [info]) as (policy, (rollout,)):
        for version in (1, 2):
            report, (got,) = _refit(policy, [rollout], _weights(model), info)
            assert got.version == version and policy.last_mode == "one-pass", (report, got)
            assert report["version"] == version and report["num_buckets"] == 0
            assert _equal(_state(target), _cast(model))  # bit for bit the trainer's own cast
            assert not rollout.receiver.stale
            with torch.no_grad():
                model.big.mul_(-1.5)
                model.steps.add_(3)
        arena = rollout.receiver.arena.tensor
        assert target.big.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_a_mismatched_manifest_is_refused_before_any_write_then_a_good_refit_lands():
    model, target = _Model(1), _Model(2, torch.bfloat16)
    info = _info(model)
    with _connected([target], [info]) as (policy, (rollout,)):
        assert _refit(policy, [rollout], _weights(model), info)[1][0].version == 1
        before = _state(target)
        grown = {**info, "big": (torch.Size([96, 65]), torch.bfloat16)}
        weights = [(n, torch.ones(96, 65) if n == "big" else t) for n, t in _weights(model)]
        sent, (got,) = _refit(policy, [rollout], iter(weights), grown)
        assert isinstance(sent, RefitRejectedError), sent
        assert re.search(r"manifest rejected.*'big'", str(sent)), sent
        assert isinstance(got, RefitError)
        assert _equal(_state(target), before)
        assert rollout.receiver.version == 1 and not rollout.receiver.stale
        with torch.no_grad():
            model.small.add_(1.0)
        report, (got,) = _refit(policy, [rollout], _weights(model), info)
        assert report["version"] == 2 and got.version == 2
        assert _equal(_state(target), _cast(model))


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_sender_failing_midway_leaves_the_receiver_as_the_one_pass_rules_say(monkeypatch, atomic):
    """ABORT reaches the rollout rank: no new version; in place some weights were written and
    the receiver is stale, atomic the live weights are the old version."""
    monkeypatch.setattr(one_pass_sender, "_GROUP_TENSORS", 1)  # each tensor lands at once
    model, target = _Model(1), _Model(2, torch.bfloat16)
    info = _info(model)
    with _connected([target], [info], atomic=atomic) as (policy, (rollout,)):
        before = _state(target)
        sent, (got,) = _refit(policy, [rollout], _failing_after(model, 2), info)
        assert isinstance(sent, OSError) and policy.last_mode == "one-pass", sent
        assert isinstance(got, RefitError) and "sender aborted" in str(got), got
        assert rollout.receiver.version == 0
        written = sum(not torch.equal(v, before[k]) for k, v in _state(target).items())
        if atomic:  # the sender wrote the spare arena only
            assert written == 0 and not rollout.receiver.stale
        else:  # some tensors were overwritten: reported, never silently mixed
            assert written >= 1 and rollout.receiver.stale
        report, (got,) = _refit(policy, [rollout], _weights(model), info)
        assert report["version"] == 1 and not rollout.receiver.stale
        assert _equal(_state(target), _cast(model))


def test_fan_out_one_by_two_casts_once_into_both_registered_arenas():
    model = _Model(1)
    targets = [_Model(2, torch.bfloat16), _Model(3, torch.bfloat16)]
    info = _info(model)
    with _connected(targets, [info, info], peers=2) as (policy, rollouts):
        for version in (1, 2):
            report, got = _refit(policy, rollouts, _weights(model), info)
            assert policy.last_mode == "one-pass fan-out", (report, got)
            assert [g.version for g in got] == [version, version]
            assert len(report["receivers"]) == 2 and report["num_buckets"] == 0
            for target in targets:
                assert _equal(_state(target), _cast(model))
            with torch.no_grad():
                model.norm.add_(1.0)
        for rollout, target in zip(rollouts, targets, strict=True):  # each its own arena
            arena = rollout.receiver.arena.tensor
            assert target.big.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        assert rollouts[0].receiver.arena.tensor.data_ptr() != (
            rollouts[1].receiver.arena.tensor.data_ptr()
        )


def test_fan_out_one_rollout_refusing_the_manifest_leaves_both_unwritten():
    """The second rollout rank's model (and refit_info) disagrees: it refuses the BEGIN, the
    first (which ACKed) is aborted, and neither arena is written."""
    model = _Model(1)
    targets = [_Model(2, torch.bfloat16), _Model(3, torch.bfloat16)]
    targets[1].norm = nn.Parameter(torch.zeros(65, dtype=torch.bfloat16))
    info = _info(model)
    other = {**info, "norm": (torch.Size([65]), torch.bfloat16)}
    before = [_state(t) for t in targets]
    with _connected(targets, [info, other], peers=2) as (policy, rollouts):
        sent, got = _refit(policy, rollouts, _weights(model), info)
        assert isinstance(sent, RefitRejectedError) and "'norm'" in str(sent), sent
        assert all(isinstance(g, RefitError) for g in got), got
        assert all(_equal(_state(t), old) for t, old in zip(targets, before, strict=True))
        assert [r.receiver.version for r in rollouts] == [0, 0]


def test_fan_out_forced_staged_lands_the_cast_in_both():
    model = _Model(1)
    targets = [_Model(2, torch.bfloat16), _Model(3, torch.bfloat16)]
    info = _info(model)
    with _connected(targets, [info, info], peers=2, one_pass=False) as (policy, rollouts):
        report, got = _refit(policy, rollouts, _weights(model), info)
        assert policy.last_mode == "staged fan-out" and report["num_buckets"] >= 1, report
        assert [g.version for g in got] == [1, 1]
        assert all(_equal(_state(t), _cast(model)) for t in targets)
        assert all(r.receiver.arena is None for r in rollouts)


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_fan_out_sender_failing_midway_gives_neither_rollout_a_new_version(monkeypatch, atomic):
    monkeypatch.setattr(one_pass_sender, "_GROUP_TENSORS", 1)
    model = _Model(1)
    targets = [_Model(2, torch.bfloat16), _Model(3, torch.bfloat16)]
    info = _info(model)
    with _connected(targets, [info, info], peers=2, atomic=atomic) as (policy, rollouts):
        before = [_state(t) for t in targets]
        sent, got = _refit(policy, rollouts, _failing_after(model, 2), info)
        assert isinstance(sent, OSError) and policy.last_mode == "one-pass fan-out", sent
        assert all(isinstance(g, RefitError) and "sender aborted" in str(g) for g in got), got
        for rollout, target, old in zip(rollouts, targets, before, strict=True):
            assert rollout.receiver.version == 0 and rollout.receiver.stale == (not atomic)
            if atomic:  # the sender wrote the spare arenas only
                assert _equal(_state(target), old)
        if not atomic:  # the first arena was cast into (the second is copied after every cast)
            assert not _equal(_state(targets[0]), before[0])
        report, got = _refit(policy, rollouts, _weights(model), info)
        assert [g.version for g in got] == [1, 1], got
        assert all(not r.receiver.stale for r in rollouts)
        assert all(_equal(_state(t), _cast(model)) for t in targets)


def test_fan_out_to_a_module_and_a_load_weights_callable_is_refused_before_any_write():
    model, target = _Model(1), _Model(2, torch.bfloat16)
    info = _info(model)
    before = _state(target)
    with _connected([target, lambda pairs: None], [info, info], peers=2) as (policy, rollouts):
        sent, got = _refit(policy, rollouts, _weights(model), info)
        assert isinstance(sent, RefitError) and "disagree" in str(sent), sent
        assert "one_pass=False" in str(sent)
        assert all(isinstance(g, RefitError) for g in got), got
        assert _equal(_state(target), before) and rollouts[0].receiver.version == 0


def test_fan_out_to_load_weights_callables_goes_staged():
    model = _Model(1)
    info = _info(model)
    loaded = [{}, {}]
    targets = [lambda pairs, d=d: d.update((n, t.clone()) for n, t in pairs) for d in loaded]
    with _connected(targets, [info, info], peers=2) as (policy, rollouts):
        report, got = _refit(policy, rollouts, _weights(model), info)
        assert policy.last_mode == "staged fan-out" and report["num_buckets"] >= 1, report
        assert [g.version for g in got] == [1, 1]
        assert all(_equal(d, _cast(model)) for d in loaded)


def test_a_load_weights_target_goes_staged_and_insisting_on_one_pass_names_the_fix():
    model = _Model(1)
    info = _info(model)
    loaded = {}

    def load_weights(pairs):
        loaded.update((name, tensor.clone()) for name, tensor in pairs)

    with _connected([load_weights], [info]) as (policy, (rollout,)):
        report, (got,) = _refit(policy, [rollout], _weights(model), info)
        assert policy.last_mode == "staged" and report["num_buckets"] >= 1, report
        assert got.version == 1 and _equal(loaded, _cast(model))
        assert rollout.receiver.arena is None
    refused = pytest.raises(ValueError, match="needs an nn.Module target.*one_pass=False")
    with _connected([load_weights], [info], one_pass=True) as (_, (rollout,)), refused:
        rollout.receive_weights()  # refused before it connects: the sender is not involved


def test_one_pass_false_keeps_a_module_target_staged_and_its_weights_in_place():
    model, target = _Model(1), _Model(2, torch.bfloat16)
    info = _info(model)
    where = target.big.data_ptr()
    with _connected([target], [info], one_pass=False) as (policy, (rollout,)):
        report, (got,) = _refit(policy, [rollout], _weights(model), info)
        assert policy.last_mode == "staged" and report["num_buckets"] >= 1, report
        assert got.version == 1 and _equal(_state(target), _cast(model))
        assert rollout.receiver.arena is None and target.big.data_ptr() == where
    with pytest.raises(ValueError, match="one_pass 'yes' must be None"):
        _policy(one_pass="yes")


def test_a_module_that_casts_on_receive_goes_staged_and_is_not_registered_again(monkeypatch):
    """An fp32 module fed a bf16 refit casts on its side, which a one-pass sender cannot do:
    its refits are staged; the declined registration is not tried again at the next join."""
    from policyworker.shell.refit import receiver as receiver_module

    tried = []
    register = receiver_module._register
    monkeypatch.setattr(
        receiver_module, "_register", lambda *a, **k: tried.append(k["where"]) or register(*a, **k)
    )
    model, target = _Model(1), _Model(2)  # fp32 weights, the refit announced in bf16
    info = _info(model)
    want = {n: t.to(target.state_dict()[n].dtype) for n, t in _cast(model).items()}
    with _connected([target], [info]) as (policy, (rollout,)):
        for _ in range(2):
            report, (got,) = _refit(policy, [rollout], _weights(model), info)
            assert policy.last_mode == "staged" and report["num_buckets"] >= 1, report
            assert _equal(_state(target), want) and rollout.receiver.arena is None
            policy.finalize()  # NeMo-RL's reconnect: a new server on the rollout side
            rollout.finalize_checkpoint_engine()
            _join(policy.prepare(), [rollout], policy=policy)
    assert len([where for where in tried if where is not None]) == 1  # None: the constructor's

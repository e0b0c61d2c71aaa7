"""Checkpoint-engine refit with our nixl backend over the real NIXL package (UCX, DRAM
registrations on CPU): this process is the policy worker, child processes are rollout ranks
hosting an HF model, driven through the same lifecycle as the collective and ipc backends'
tests; then the refusals, the atomic option and a dead peer, in one process."""

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.shell.refit.checkpoint_engine import (
    CheckpointEngineRollout,
    create_checkpoint_engine,
)
from tests.shell.refit.test_checkpoint_engine import (
    _children,
    _close,
    _connect,
    _receive,
    _trainer_logprobs,
    one_of_two_rollout_ranks_killed_then_a_send_works,
    rpc,
    run_two_policy_ranks,
    worker,  # noqa: F401 -- the module's policy worker fixture
)

OPTIONS = {"device": "cpu", "timeout_s": 5.0}
ENGINE = {"backend": "nixl", "bucket_size_bytes": 4096, "engine_kwargs": OPTIONS}
STAGED = {**ENGINE, "engine_kwargs": {**OPTIONS, "one_pass": False}}


@pytest.fixture(scope="module")
def children(worker, tiny_model_paths, tmp_path_factory):  # noqa: F811
    started = _children(2, worker, tiny_model_paths["qwen2"], tmp_path_factory.mktemp("nixl"))
    try:
        yield started
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close(started)


def _check_received(worker, children, model_dir, tmp_path):  # noqa: F811
    sent = dict(worker._checkpoint_engine_params())
    expected = _trainer_logprobs(model_dir, sent)
    for i in range(len(children)):
        got = load_file(tmp_path / f"out{i}.safetensors")
        for name, tensor in sent.items():
            assert torch.equal(got[name], tensor), (i, name)
        assert torch.equal(got["logprobs"], expected)  # fp32: bitwise the trainer's


def test_nixl_lifecycle_one_policy_rank_into_two_rollout_processes_bitwise_fp32(
    worker,  # noqa: F811
    children,
    tiny_model_paths,
    tmp_path,
):
    _connect(worker, children, ENGINE)
    for version in (1, 2):
        _receive(children, tmp_path)
        assert rpc(worker, "send_weights_via_checkpoint_engine") is None
        answers = [child.reply() for child in children]
        assert all(a["ok"] and a["version"] == version for a in answers), answers
        report = worker.checkpoint_engine.last_report
        # 4096-byte buckets: the stream was split, each bucket written to both rollout ranks,
        # straight into their weight arenas (nn.Module targets register: one-pass)
        assert answers[0]["num_buckets"] == report["num_buckets"] > 1
        assert [r["version"] for r in report["receivers"]] == [version, version]
        assert report["modes"] == ["one-pass", "one-pass"]
        assert worker.checkpoint_engine.last_mode == "one-pass"
        _check_received(worker, children, tiny_model_paths["qwen2"], tmp_path)
        worker._add_noise_to_weights()
    rpc(worker, "finalize_checkpoint_engine")
    for child in children:
        child.send(op="rpc", method="finalize_checkpoint_engine", args=[])
        assert child.reply()["ok"]


def test_nixl_staged_into_a_rollout_process_bitwise_fp32(worker, tiny_model_paths, tmp_path):  # noqa: F811
    """one_pass=False on the rollout rank: buckets land in its registered slots, then applied."""
    (child,) = _children(1, worker, tiny_model_paths["qwen2"], tmp_path)
    try:
        _connect(worker, [child], STAGED)
        for version in (1, 2):
            _receive([child], tmp_path)
            rpc(worker, "send_weights_via_checkpoint_engine")
            answer = child.reply()
            assert answer["ok"] and answer["version"] == version, answer
            assert worker.checkpoint_engine.last_report["modes"] == ["staged"]
            _check_received(worker, [child], tiny_model_paths["qwen2"], tmp_path)
            worker._add_noise_to_weights()
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close([child])


def test_nixl_two_policy_ranks_into_one_rollout_process_bitwise_fp32(
    children, tiny_model_paths, tmp_path
):
    run_two_policy_ranks(children[0], ENGINE, tiny_model_paths["qwen2"], tmp_path)


def test_nixl_rollout_rank_killed_mid_send_every_policy_rank_raises_then_a_send_works(
    worker,  # noqa: F811
    children,
    tiny_model_paths,
    tmp_path,
):
    live, dying = children
    rank0, rank1 = run_two_policy_ranks(
        dying, ENGINE, tiny_model_paths["qwen2"], tmp_path, die_after_buckets=1
    )
    # rank 0 waits at most timeout_s (5 s) for the dead rollout rank; rank 1 is released
    assert float(rank0.split()[0]) < 15 and "may be dead" in rank0, rank0
    assert float(rank1.split()[0]) < 15 and "failed on another policy rank" in rank1, rank1
    live.send(op="rpc", method="finalize_checkpoint_engine", args=[])
    assert live.reply()["ok"]
    _connect(worker, [live], ENGINE)
    _receive([live], tmp_path)
    rpc(worker, "send_weights_via_checkpoint_engine")
    assert live.reply()["ok"]
    _check_received(worker, [live], tiny_model_paths["qwen2"], tmp_path)
    rpc(worker, "finalize_checkpoint_engine")
    live.send(op="rpc", method="finalize_checkpoint_engine", args=[])
    assert live.reply()["ok"]


def test_nixl_one_of_two_rollout_ranks_killed_aborts_the_other_then_a_send_works(
    worker,  # noqa: F811
    children,
    tiny_model_paths,
    tmp_path,
):
    one_of_two_rollout_ranks_killed_then_a_send_works(
        worker,
        children[0],
        tiny_model_paths["qwen2"],
        tmp_path,
        ENGINE,
        dead_match="rollout rank 1 .*may be dead",
        aborted_marker="aborted the refit",
    )


# ----------------------------------------------------------------- one process, two threads


def _model():
    return nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))


def _pair(served, info, *, atomic=False, **options):
    policy = create_checkpoint_engine(
        "nixl", bucket_size_bytes=2048, engine_kwargs={**OPTIONS, **options}
    )
    rollout = CheckpointEngineRollout(served, refit_info=info, atomic=atomic)
    rollout.init_checkpoint_engine("nixl", 2048, {**OPTIONS, **options})
    metadata = [policy.prepare(), rollout.prepare_checkpoint_engine()]
    rollout.init_checkpoint_engine_process_group(0, 1, 1, metadata)
    policy.init_policy_process_group(
        worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    return policy, rollout


def _refit(policy, rollout, stream, info):
    """One refit on two threads; (the policy's error or report, the rollout's error or report)."""
    out = {}

    def receive():
        try:
            out["rollout"] = rollout.receive_weights()
        except Exception as exc:  # noqa: BLE001 -- handed to the test
            out["rollout"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sent = asyncio.run(policy.send_weights(iter(stream), refit_info=info))
    except Exception as exc:  # noqa: BLE001 -- handed to the test
        sent = exc
    thread.join(timeout=30)
    return sent, out["rollout"]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.values(), b.values(), strict=True))


def test_nixl_manifest_mismatch_is_refused_before_any_byte_then_a_good_refit_works():
    trainer, served = _model(), _model()
    info = {n: (t.shape, t.dtype) for n, t in trainer.state_dict().items()}
    before = {n: t.clone() for n, t in served.state_dict().items()}
    policy, rollout = _pair(served, info)
    try:
        wrong = {**info, "1.bias": (torch.Size([9]), torch.float32)}
        stream = [
            (n, torch.zeros(9) if n == "1.bias" else t) for n, t in trainer.state_dict().items()
        ]
        sent, received = _refit(policy, rollout, stream, wrong)
        assert isinstance(sent, RefitError) and "refused the refit before any byte" in str(sent)
        assert "'1.bias'" in str(sent), sent  # the difference is named
        assert isinstance(received, RefitError) and "refused before any byte" in str(received)
        assert _same(served.state_dict(), before) and rollout.receiver.version == 0
        sent, received = _refit(policy, rollout, trainer.state_dict().items(), info)
        assert sent["num_buckets"] > 1 and received.version == 1
        assert _same(served.state_dict(), trainer.state_dict())
    finally:
        policy.finalize()
        rollout.finalize_checkpoint_engine()


@pytest.mark.parametrize("one_pass", [None, False], ids=["one_pass", "staged"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_nixl_stream_failing_mid_refit_leaves_an_atomic_rollout_untouched(atomic, one_pass):
    """Atomic: one-pass WRITEs go to the spare arena, staged buckets are staged by the applier;
    nothing reaches the live weights until every bucket arrived."""
    trainer, served = _model(), _model()
    info = {n: (t.shape, t.dtype) for n, t in trainer.state_dict().items()}
    before = {n: t.clone() for n, t in served.state_dict().items()}
    policy, rollout = _pair(served, info, atomic=atomic, num_buffers=1, one_pass=one_pass)
    try:
        pairs = list(trainer.state_dict().items())
        broken = [*pairs[:-1], ("not.in.refit_info", pairs[-1][1])]  # fails at the last bucket
        sent, received = _refit(policy, rollout, broken, info)
        assert isinstance(sent, RefitError) and "disagree" in str(sent), sent
        assert isinstance(received, RefitError) and "aborted the refit" in str(received)
        assert rollout.receiver.version == 0
        # atomic: nothing applied until every bucket arrived; in place: the first ones landed
        assert _same(served.state_dict(), before) == atomic
        assert rollout.receiver.stale == (not atomic)
        sent, received = _refit(policy, rollout, pairs, info)
        assert received.version == 1 and _same(served.state_dict(), trainer.state_dict())
        assert not rollout.receiver.stale
        assert sent["modes"] == ["staged" if one_pass is False else "one-pass"]
    finally:
        policy.finalize()
        rollout.finalize_checkpoint_engine()


def test_nixl_load_weights_target_is_staged_and_gets_every_tensor():
    """A callable cannot register its memory: the refit goes through the slots."""
    trainer = _model()
    info = {n: (t.shape, t.dtype) for n, t in trainer.state_dict().items()}
    got = {}
    policy, rollout = _pair(lambda pairs: got.update((n, t.clone()) for n, t in pairs), info)
    try:
        sent, received = _refit(policy, rollout, trainer.state_dict().items(), info)
        assert sent["modes"] == ["staged"] and received.version == 1
        assert _same(got, trainer.state_dict())
    finally:
        policy.finalize()
        rollout.finalize_checkpoint_engine()


def test_nixl_silent_rollout_rank_is_a_named_timeout_and_options_are_checked():
    trainer, served = _model(), _model()
    info = {n: (t.shape, t.dtype) for n, t in trainer.state_dict().items()}
    policy, rollout = _pair(served, info, timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(
            RefitTimeoutError, match="'BEGIN answer' within 1 s from rollout rank 0"
        ):
            asyncio.run(policy.send_weights(iter(trainer.state_dict().items()), refit_info=info))
        assert time.monotonic() - started < 5
        # the rollout rank comes late: the stale BEGIN (and its ABORT) are skipped, the next works
        sent, received = _refit(policy, rollout, trainer.state_dict().items(), info)
        assert not isinstance(received, Exception), (received, sent)
        assert received.version == 1 and _same(served.state_dict(), trainer.state_dict())
    finally:
        policy.finalize()
        rollout.finalize_checkpoint_engine()
    for bad in (0, 17, True):
        with pytest.raises(ValueError, match=r"num_buffers .* must be an int in \[1, 16\]"):
            create_checkpoint_engine(
                "nixl", bucket_size_bytes=64, engine_kwargs={"num_buffers": bad}
            )
    with pytest.raises(RefitError, match="needs prepare"):
        create_checkpoint_engine(
            "nixl", bucket_size_bytes=64, engine_kwargs=OPTIONS
        ).receive_weights(rollout.receiver)

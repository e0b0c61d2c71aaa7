"""Checkpoint-engine refit with the ipc backend (colocated: our ZMQ transport over /dev/shm on
CPU): this process is the policy worker, a child process the rollout rank hosting an HF model,
driven through the same lifecycle as the collective backend's test."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from policyworker.shell.refit.checkpoint_engine import create_checkpoint_engine
from tests.shell.refit.test_checkpoint_engine import (
    _children,
    _close,
    _connect,
    _receive,
    _trainer_logprobs,
    next_send_reaches,
    one_of_two_rollout_ranks_killed_then_a_send_works,
    rpc,
    run_two_policy_ranks,
    worker,  # noqa: F401 -- the module's policy worker fixture
)

ENGINE = {
    "backend": "ipc",
    "bucket_size_bytes": 4096,
    # two sockets per policy rank: the worker's one engine (a repeated init is a no-op) serves
    # both 1 x 1 and 1 x 2; a policy rank closes the sockets no rollout rank joins
    "engine_kwargs": {"device": "cpu", "timeout_s": 5.0, "peers_per_rank": 2},
}


@pytest.fixture(scope="module")
def children(worker, tiny_model_paths, tmp_path_factory):  # noqa: F811
    started = _children(2, worker, tiny_model_paths["qwen2"], tmp_path_factory.mktemp("ipc"))
    try:
        yield started
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close(started)


def test_ipc_lifecycle_into_a_colocated_rollout_process_bitwise_fp32(
    worker,  # noqa: F811
    children,
    tiny_model_paths,
    tmp_path,
):
    live = children[0]
    _connect(worker, [live], ENGINE)
    for version in (1, 2):
        _receive([live], tmp_path)
        assert rpc(worker, "send_weights_via_checkpoint_engine") is None
        answer = live.reply()
        assert answer["ok"] and answer["version"] == version, answer
        # an nn.Module rollout target registers: one-pass, no bucket
        assert answer["num_buckets"] == 0 and worker.checkpoint_engine.last_mode == "one-pass"
        sent = dict(worker._checkpoint_engine_params())
        got = load_file(tmp_path / "out0.safetensors")
        for name, tensor in sent.items():
            assert torch.equal(got[name], tensor), name
        assert torch.equal(got["logprobs"], _trainer_logprobs(tiny_model_paths["qwen2"], sent))
        worker._add_noise_to_weights()
    assert worker.checkpoint_engine.last_report is not None
    rpc(worker, "finalize_checkpoint_engine")


def test_ipc_one_policy_rank_into_two_rollout_ranks_casts_once_bitwise_fp32(
    worker,  # noqa: F811
    children,
    tiny_model_paths,
    tmp_path,
):
    _connect(worker, children, ENGINE)
    assert len(worker.checkpoint_engine.senders) == 2
    for _ in range(2):
        _receive(children, tmp_path)
        rpc(worker, "send_weights_via_checkpoint_engine")
        answers = [child.reply() for child in children]
        assert all(a["ok"] for a in answers), answers
        report = worker.checkpoint_engine.last_report
        # each rollout rank registered its own arena: cast once, copied into the other's
        assert len(report["receivers"]) == 2 and answers[1]["num_buckets"] == 0
        assert worker.checkpoint_engine.last_mode == "one-pass fan-out"
        sent = dict(worker._checkpoint_engine_params())
        expected = _trainer_logprobs(tiny_model_paths["qwen2"], sent)
        for i in range(2):
            got = load_file(tmp_path / f"out{i}.safetensors")
            for name, tensor in sent.items():
                assert torch.equal(got[name], tensor), name
            assert torch.equal(got["logprobs"], expected)
        worker._add_noise_to_weights()
    rpc(worker, "finalize_checkpoint_engine")
    for child in children:
        child.send(op="rpc", method="finalize_checkpoint_engine", args=[])
        assert child.reply()["ok"]


def _members(n, **kwargs):
    engines = [
        create_checkpoint_engine(
            "ipc", bucket_size_bytes=4096, engine_kwargs={"device": "cpu", **kwargs}
        )
        for _ in range(n)
    ]
    return engines, [engine.prepare() for engine in engines]


def test_ipc_refuses_topologies_it_cannot_serve_by_name():
    engines, metadata = _members(3)
    try:
        with pytest.raises(ValueError, match="peers_per_rank=2"):  # 1 policy rank, 2 rollout
            engines[0].init_policy_process_group(
                worker_rank=0, train_world_size=1, rollout_world_size=2, metadata=metadata
            )
        with pytest.raises(ValueError, match="peers_per_rank=2"):
            engines[2].init_rollout_process_group(
                rollout_rank=1, train_world_size=1, rollout_world_size=2, metadata=metadata
            )
        away = [metadata[0], {**metadata[1], "host": "elsewhere"}, metadata[2]]
        with pytest.raises(ValueError, match=r"hosts \['elsewhere'\].*collective backend"):
            engines[0].init_policy_process_group(
                worker_rank=0, train_world_size=1, rollout_world_size=2, metadata=away
            )
        cuda = [metadata[0], {**metadata[1], "device": "cuda"}]
        with pytest.raises(ValueError, match="members offer devices"):
            engines[0].init_policy_process_group(
                worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=cuda
            )
        with pytest.raises(ValueError, match="peers_per_rank 0 must be an int >= 1"):
            _members(1, peers_per_rank=0)
        # three policy ranks, two rollout ranks: the third joins with no peer and sends nothing
        five = metadata + metadata[:2]
        engines[2].init_policy_process_group(
            worker_rank=2, train_world_size=3, rollout_world_size=2, metadata=five
        )
        assert engines[2].peers == [] and engines[2].senders == []
        assert asyncio.run(engines[2].send_weights(iter([("w", torch.ones(2))]))) is None
    finally:
        for engine in engines:
            engine.finalize()


def test_ipc_two_policy_ranks_into_one_rollout_rank_rank_one_only_gathers(
    children, tiny_model_paths, tmp_path
):
    run_two_policy_ranks(children[0], ENGINE, tiny_model_paths["qwen2"], tmp_path, one_pass=True)


def test_ipc_rollout_rank_killed_under_two_policy_ranks_every_rank_raises_then_a_send_works(
    worker,  # noqa: F811
    children,
    tiny_model_paths,
    tmp_path,
):
    live, dying = children
    model_dir = tiny_model_paths["qwen2"]
    rank0, rank1 = run_two_policy_ranks(dying, ENGINE, model_dir, tmp_path, die_after_buckets=1)
    # rank 0 waits timeout_s (5 s) for the dead receiver; rank 1, in its gathers, is released
    assert float(rank0.split()[0]) < 15 and "may be dead or unresponsive" in rank0, rank0
    assert float(rank1.split()[0]) < 15 and "failed on another policy rank" in rank1, rank1
    # the next refit, from this process's worker into a live rollout rank, works
    next_send_reaches(worker, live, tmp_path, ENGINE)


def test_ipc_one_of_two_rollout_ranks_killed_aborts_the_other_then_a_send_works(
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
        dead_match="may be dead or unresponsive",
        aborted_marker="another rollout rank",
    )

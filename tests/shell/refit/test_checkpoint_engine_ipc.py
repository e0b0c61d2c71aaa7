"""Checkpoint-engine refit with the ipc backend (colocated: our ZMQ transport over /dev/shm on
CPU): this process is the policy worker, a child process the rollout rank hosting an HF model,
driven through the same lifecycle as the collective backend's test."""

import pytest
import torch
from safetensors.torch import load_file

from tests.shell.refit.test_checkpoint_engine import (
    _children,
    _close,
    _connect,
    _receive,
    _trainer_logprobs,
    rpc,
    run_two_policy_ranks,
    worker,  # noqa: F401 -- the module's policy worker fixture
)

ENGINE = {
    "backend": "ipc",
    "bucket_size_bytes": 4096,
    "engine_kwargs": {"device": "cpu", "timeout_s": 5.0},
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
        assert answer["num_buckets"] > 1
        sent = dict(worker._checkpoint_engine_params())
        got = load_file(tmp_path / "out0.safetensors")
        for name, tensor in sent.items():
            assert torch.equal(got[name], tensor), name
        assert torch.equal(got["logprobs"], _trainer_logprobs(tiny_model_paths["qwen2"], sent))
        worker._add_noise_to_weights()
    assert worker.checkpoint_engine.last_report is not None
    rpc(worker, "finalize_checkpoint_engine")


def test_ipc_two_policy_ranks_into_one_rollout_rank_rank_one_only_gathers(
    children, tiny_model_paths, tmp_path
):
    run_two_policy_ranks(children[0], ENGINE, tiny_model_paths["qwen2"], tmp_path)


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
    live.send(op="rpc", method="finalize_checkpoint_engine", args=[])
    assert live.reply()["ok"]
    _connect(worker, [live], ENGINE)
    _receive([live], tmp_path)
    rpc(worker, "send_weights_via_checkpoint_engine")
    assert live.reply()["ok"]
    got = load_file(tmp_path / "out0.safetensors")
    for name, tensor in worker._checkpoint_engine_params():
        assert torch.equal(got[name], tensor), name

"""Checkpoint-engine refit on CUDA: the ipc backend through CUDA IPC handles on one GPU (policy
worker here, rollout models in child processes on the same device: 1 x 1 one-pass into the
rollout's registered arena and staged, 1 x 2 one-pass into both arenas and staged), and the
collective backend over NCCL, which needs two GPUs (NCCL refuses two ranks on one device)."""

import pytest
import torch
from safetensors.torch import load_file

from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_config
from tests.shell.refit.test_checkpoint_engine import (
    _children,
    _close,
    _connect,
    _receive,
    rpc,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def worker(tiny_model_paths):
    w = PolicyWorker(make_config(tiny_model_paths["qwen2"]), init_reference_model=False)
    assert w.device.type == "cuda"
    return w


def _check_refits(worker, child, tmp_path, *, one_pass=False):
    for version in (1, 2):
        _receive([child], tmp_path)
        rpc(worker, "send_weights_via_checkpoint_engine")
        answer = child.reply()
        assert answer["ok"] and answer["version"] == version, answer
        # one-pass: cast straight into the rollout's registered arena, no bucket
        assert answer["num_buckets"] == 0 if one_pass else answer["num_buckets"] > 1
        got = load_file(tmp_path / "out0.safetensors")
        for name, tensor in worker._checkpoint_engine_params():
            assert torch.equal(got[name], tensor.cpu()), name
        worker._add_noise_to_weights()
    rpc(worker, "finalize_checkpoint_engine")


@pytest.mark.parametrize("one_pass", [None, False], ids=["default_one_pass", "staged"])
def test_ipc_backend_over_cuda_ipc_into_a_rollout_process_on_the_same_gpu(
    worker, tiny_model_paths, tmp_path, one_pass
):
    children = _children(1, worker, tiny_model_paths["qwen2"], tmp_path, devices=["cuda:0"])
    engine = {
        "backend": "ipc",
        "bucket_size_bytes": 1 << 16,
        "engine_kwargs": {"device": "cuda:0", "timeout_s": 60.0, "one_pass": one_pass},
    }
    try:
        _connect(worker, children, engine)
        assert worker.checkpoint_engine.device.type == "cuda"
        _check_refits(worker, children[0], tmp_path, one_pass=one_pass is None)
        assert worker.checkpoint_engine.last_mode == ("one-pass" if one_pass is None else "staged")
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close(children)


@pytest.mark.parametrize("one_pass", [None, False], ids=["default_one_pass", "staged"])
def test_ipc_backend_one_policy_rank_into_two_rollout_processes_on_the_same_gpu(
    worker, tiny_model_paths, tmp_path, one_pass
):
    """One-pass (default): each rollout rank registers a CUDA arena, every tensor is cast once
    into the first and copied into the second before the written event. Staged: one cast per
    bucket into a CUDA IPC buffer both rollout ranks map; the buffer is rewritten only after
    both consumed events (the second one waited by the fan-out)."""
    children = _children(
        2, worker, tiny_model_paths["qwen2"], tmp_path, devices=["cuda:0", "cuda:0"]
    )
    engine = {
        "backend": "ipc",
        "bucket_size_bytes": 1 << 16,
        "engine_kwargs": {
            "device": "cuda:0",
            "timeout_s": 60.0,
            "peers_per_rank": 2,
            "one_pass": one_pass,
        },
    }
    try:
        _connect(worker, children, engine)
        assert len(worker.checkpoint_engine.senders) == 2
        for version in (1, 2):
            _receive(children, tmp_path)
            rpc(worker, "send_weights_via_checkpoint_engine")
            answers = [child.reply() for child in children]
            assert all(a["ok"] and a["version"] == version for a in answers), answers
            mode = worker.checkpoint_engine.last_mode
            if one_pass is None:  # each rollout rank registered its own arena
                assert answers[0]["num_buckets"] == 0 and mode == "one-pass fan-out"
            else:
                assert answers[0]["num_buckets"] > 1 and mode == "staged fan-out"
            sent = {n: t.cpu() for n, t in worker._checkpoint_engine_params()}
            for i in range(2):
                got = load_file(tmp_path / f"out{i}.safetensors")
                for name, tensor in sent.items():
                    assert torch.equal(got[name], tensor), (i, name)
            worker._add_noise_to_weights()
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close(children)


@pytest.mark.multigpu
def test_collective_backend_over_nccl_into_a_rollout_process_on_another_gpu(
    worker, tiny_model_paths, tmp_path
):
    children = _children(1, worker, tiny_model_paths["qwen2"], tmp_path, devices=["cuda:1"])
    kwargs = {"host": "127.0.0.1", "timeout_s": 60.0}
    policy = {
        "backend": "collective",
        "bucket_size_bytes": 1 << 16,
        "engine_kwargs": {**kwargs, "device": "cuda:0"},
    }
    try:
        # each side names its own device; the two only have to agree on its type
        rpc(worker, "init_checkpoint_engine", **policy)
        children[0].send(
            op="rpc",
            method="init_checkpoint_engine",
            args=["collective", 1 << 16, {**kwargs, "device": "cuda:1"}],
        )
        assert children[0].reply()["ok"]
        _connect(worker, children, policy)
        _check_refits(worker, children[0], tmp_path)
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close(children)

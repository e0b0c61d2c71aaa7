"""The nixl checkpoint engine on CUDA: VRAM to VRAM through NIXL (UCX's CUDA IPC on one GPU),
the policy worker here and rollout models in child processes on the same device, 1 x 1 and
1 x 2, one-pass (WRITEs into each rollout model's weight arena) and staged (into registered
slots, then applied), every tensor checked bitwise against the trainer's."""

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


@pytest.mark.parametrize("one_pass", [None, False], ids=["one_pass", "staged"])
@pytest.mark.parametrize("num_rollout", [1, 2], ids=["1x1", "1x2"])
def test_nixl_backend_vram_to_vram_into_rollout_processes_on_the_same_gpu(
    worker, tiny_model_paths, tmp_path, num_rollout, one_pass
):
    children = _children(
        num_rollout, worker, tiny_model_paths["qwen2"], tmp_path, devices=["cuda:0"] * num_rollout
    )
    engine = {
        "backend": "nixl",
        "bucket_size_bytes": 1 << 16,
        "engine_kwargs": {"device": "cuda:0", "timeout_s": 60.0, "one_pass": one_pass},
    }
    try:
        _connect(worker, children, engine)
        for version in (1, 2):
            _receive(children, tmp_path)
            rpc(worker, "send_weights_via_checkpoint_engine")
            answers = [child.reply() for child in children]
            assert all(a["ok"] and a["version"] == version for a in answers), answers
            assert answers[0]["num_buckets"] > 1  # 64 KiB buckets: the stream was split
            report = worker.checkpoint_engine.last_report
            mode = "staged" if one_pass is False else "one-pass"
            assert report["modes"] == [mode] * num_rollout, report
            assert worker.checkpoint_engine._slots.buffer.is_cuda  # VRAM registered
            sent = {n: t.cpu() for n, t in worker._checkpoint_engine_params()}
            for i in range(num_rollout):
                got = load_file(tmp_path / f"out{i}.safetensors")
                for name, tensor in sent.items():
                    assert torch.equal(got[name], tensor), (i, name)
            worker._add_noise_to_weights()
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close(children)

"""Checkpoints of a CUDA worker: the sync save's bounce-buffer copy-out of weights and optimizer.

A sync save of CUDA weights and AdamW state loads back bit-exact and writes the same weight files
as an async save (pinned staging) of the same state, also when the bounce chunks are smaller than
one run and the optimizer step's kernels are still queued when the save starts.
"""

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell import checkpoint as ck
from policyworker.shell.checkpoint import bounce
from policyworker.shell.worker.policy_worker import PolicyWorker

# the session fixture tiny_model_paths comes from tests/gpu/conftest.py
from tests.helpers import (
    assert_same_checkpoint_state,
    checkpoint_state,
    optimizer_tensor_bytes,
    safetensors_shards,
)
from tests.shell.conftest import make_batch, make_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chunk", [None, 4099])
def test_a_sync_save_of_cuda_state_loads_back_bit_exact_and_matches_an_async_save(
    tiny_model_paths, tmp_path, monkeypatch, chunk
):
    path = tiny_model_paths["qwen2"]
    worker = PolicyWorker(make_config(path), init_reference_model=False)
    assert worker.device.type == "cuda"
    assert worker.train(make_batch(4, 10, seed=5), NLLLoss())["skipped_steps"] == 0
    torch.cuda.synchronize()
    want = checkpoint_state(worker)
    ck.save_checkpoint(worker.state, tmp_path / "async", tmp_path / "async")
    ck.finalize_async_save(worker.state)
    worker.state.saver.release_staging()
    if chunk is not None:
        monkeypatch.setattr(bounce, "BOUNCE_BYTES", chunk)
    sizes: list[int] = []
    copy_out = bounce.Bounce.copy_out
    monkeypatch.setattr(
        bounce.Bounce,
        "copy_out",
        lambda self, src, ready: sizes.append(src.numel()) or copy_out(self, src, ready),
    )
    ck.save_checkpoint(worker.state, tmp_path / "sync", tmp_path / "sync", is_final_checkpoint=True)
    monkeypatch.undo()
    assert sizes and max(sizes) <= (bounce.BOUNCE_BYTES if chunk is None else chunk)
    optimizer_device_bytes = optimizer_tensor_bytes(worker.optimizer, cuda_only=True)
    weight_bytes = sum(t.nbytes for t in worker.model.state_dict().values())
    # every device byte went through the bounce buffers: the weights (tied embeddings once at
    # most) and all of the optimizer's CUDA state (DCP's writer threads, through the planner)
    assert sum(sizes) >= optimizer_device_bytes > 0
    assert sum(sizes) <= weight_bytes + optimizer_device_bytes
    assert worker.state.saver.staging.nbytes == 0  # a sync save keeps no staging buffers
    shards = safetensors_shards(tmp_path / "async")
    assert shards and safetensors_shards(tmp_path / "sync") == shards
    for name in ("async", "sync"):
        fresh = PolicyWorker(make_config(path), init_reference_model=False)
        ck.load_checkpoint(fresh.state, tmp_path / name, tmp_path / name)
        assert_same_checkpoint_state(checkpoint_state(fresh), want)


def test_a_sync_save_started_behind_queued_optimizer_kernels_saves_their_result(
    tiny_model_paths, tmp_path
):
    """The writer streams wait on the caller's stream: values written by kernels still queued
    when the save starts are the ones saved."""
    path = tiny_model_paths["qwen2"]
    worker = PolicyWorker(make_config(path), init_reference_model=False)
    assert worker.train(make_batch(4, 10, seed=6), NLLLoss())["skipped_steps"] == 0
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of queued GPU time before the writes below
        for p in worker.model.parameters():
            p.add_(1.0)
        for s in worker.optimizer.state.values():
            s["exp_avg"].add_(1.0)
    ck.save_checkpoint(worker.state, tmp_path / "s", tmp_path / "s", is_final_checkpoint=True)
    want = checkpoint_state(worker)
    fresh = PolicyWorker(make_config(path), init_reference_model=False)
    ck.load_checkpoint(fresh.state, tmp_path / "s", tmp_path / "s")
    assert_same_checkpoint_state(checkpoint_state(fresh), want)

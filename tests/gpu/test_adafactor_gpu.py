"""torch.optim.Adafactor in the worker on one CUDA device: its factored state leaves the device
around a rollout and comes back unchanged, the next step equals one taken without the round
trip, and the planner's optimizer terms are the state the device held."""

import gc

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.worker.policy_worker import PolicyWorker

# the session fixture tiny_model_paths comes from tests/gpu/conftest.py
from tests.shell.conftest import make_batch, make_config

pytestmark = pytest.mark.gpu

ADAFACTOR = {"name": "torch.optim.Adafactor", "kwargs": {"lr": 1e-2}}


def _worker(path, **overrides):
    cfg = make_config(path, precision="bfloat16", optimizer=ADAFACTOR, **overrides)
    return PolicyWorker(cfg, init_reference_model=False)


def _state(worker):
    return {
        i: {k: v.detach().cpu().clone() for k, v in s.items()}
        for i, s in worker.optimizer.state_dict()["state"].items()
    }


def _state_bytes_on_cuda(worker):
    return sum(
        v.numel() * v.element_size()
        for s in worker.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.is_cuda and v.ndim > 0
    )


def test_adafactor_state_leaves_the_device_around_a_rollout_and_comes_back_unchanged(
    tiny_model_paths,
):
    """Weights and state equal bit for bit after the round trip, so the next step is the one
    the worker would have taken without it (the backward itself is not bit-reproducible on
    CUDA, so two workers are not compared)."""
    worker = _worker(tiny_model_paths["qwen2"])
    data = make_batch(8, 16, seed=34)
    for _ in range(2):
        worker.train(data, NLLLoss())
    held = _state_bytes_on_cuda(worker)
    assert held > 0
    assert worker.plan_memory()["checkpoint"]["terms"]["optimizer_state"] == held
    state = _state(worker)
    weights = {k: v.detach().cpu().clone() for k, v in worker.model.state_dict().items()}
    worker.offload_before_refit()
    worker.offload_after_refit()
    gc.collect()
    assert _state_bytes_on_cuda(worker) == 0
    assert all(p.device.type == "cpu" for p in worker.model.parameters())
    worker.prepare_for_training()
    assert _state_bytes_on_cuda(worker) == held
    after = _state(worker)
    assert all(torch.equal(after[i][k], v) for i, s in state.items() for k, v in s.items())
    live = worker.model.state_dict()
    assert all(torch.equal(live[k].cpu(), v) for k, v in weights.items())
    steps = {float(s["step"]) for s in worker.optimizer.state.values()}
    assert worker.train(data, NLLLoss())["skipped_steps"] == 0
    # 8 rows at train_global_batch_size 4: two optimizer steps per call, on every parameter
    assert {float(s["step"]) for s in worker.optimizer.state.values()} == {max(steps) + 2}
    assert len(steps) == 1

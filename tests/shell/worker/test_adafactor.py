"""torch.optim.Adafactor through the worker (CPU): it trains, its factored state survives a
checkpoint round trip and the offload calls around a rollout exactly, the planner counts that
state, and the refit of its weights is the same as under AdamW."""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
import yaml

from bench.common import QWEN25_7B
from policyworker.config import load_config
from policyworker.functional.loss import NLLLoss
from policyworker.functional.memory_plan import plan_memory
from policyworker.functional.optimizer_memory import factored_state_elements
from policyworker.shell import checkpoint as ck
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.worker import memory_calls
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.helpers import refit_through
from tests.shell.conftest import make_batch, make_config

ADAFACTOR = {"name": "torch.optim.Adafactor", "kwargs": {"lr": 1e-2}}
SCHEDULER = {"name": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 1, "gamma": 0.7}}


def _worker(path: str, **overrides) -> PolicyWorker:
    cfg = make_config(path, optimizer=ADAFACTOR, scheduler=SCHEDULER, **overrides)
    return PolicyWorker(cfg, init_reference_model=False)


def _train(worker: PolicyWorker, steps) -> list[float]:
    return [
        float(worker.train(make_batch(4, 10, seed=100 + s), NLLLoss())["global_loss"][0])
        for s in steps
    ]


def _optimizer_state(worker: PolicyWorker) -> dict:
    return {
        i: {k: v.detach().clone() for k, v in s.items()}
        for i, s in worker.optimizer.state_dict()["state"].items()
    }


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i, state in a.items():
        assert state.keys() == b[i].keys(), i
        for k, v in state.items():
            assert torch.equal(v.cpu(), b[i][k].cpu()), (i, k)


def _weights(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def test_adafactor_keeps_row_and_column_statistics_and_the_loss_falls(tiny_model_paths):
    worker = _worker(tiny_model_paths["qwen2"])
    assert type(worker.optimizer).__name__ == "Adafactor"
    data = make_batch(4, 10, seed=3)
    losses = [float(worker.train(data, NLLLoss())["global_loss"][0]) for _ in range(6)]
    assert losses[-1] < losses[0] - 0.05, losses
    for p in worker.model.parameters():
        state = worker.optimizer.state[p]
        if p.ndim >= 2:
            assert state["row_var"].shape == (*p.shape[:-1], 1)
            assert state["col_var"].shape == (*p.shape[:-2], 1, p.shape[-1])
            assert "variance" not in state
        else:
            assert state["variance"].shape == p.shape


def test_the_plan_counts_the_factored_state_the_optimizer_holds(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"])
    _train(worker, range(1))
    held = sum(
        v.numel() * v.element_size()
        for s in worker.optimizer.state.values()
        for k, v in s.items()
        if k != "step"  # a host scalar per parameter, not device memory
    )
    shapes = [tuple(p.shape) for p in worker.model.parameters()]
    assert held == 4 * factored_state_elements(shapes)
    table = worker.plan_memory()
    assert table["train_step"]["terms"]["optimizer_state"] == held
    assert table["checkpoint"]["terms"]["optimizer_state"] == held
    largest = max(p.numel() for p in worker.model.parameters())
    assert table["optimizer_step"]["terms"]["update_scratch"] == 4 * largest


def test_checkpoint_round_trip_restores_the_factored_state_and_resumes_bit_identically(
    tiny_model_paths, tmp_path
):
    path = tiny_model_paths["llama"]
    straight = _worker(path)
    _train(straight, range(4))
    first = _worker(path)
    _train(first, range(2))
    ck.save_checkpoint(first.state, tmp_path / "weights", tmp_path / "optimizer")
    ck.finalize_async_save(first.state)
    resumed = _worker(path)
    ck.load_checkpoint(resumed.state, tmp_path / "weights", tmp_path / "optimizer")
    _assert_same_state(_optimizer_state(resumed), _optimizer_state(first))
    assert resumed.scheduler.state_dict() == first.scheduler.state_dict()
    assert float(resumed.optimizer.state_dict()["state"][0]["step"]) == 2.0
    _train(resumed, range(2, 4))
    _assert_same_state(_optimizer_state(resumed), _optimizer_state(straight))
    want, got = _weights(straight), _weights(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_adamw_state_is_refused_by_an_adafactor_worker_naming_both(tiny_model_paths, tmp_path):
    path = tiny_model_paths["llama"]
    adamw = PolicyWorker(make_config(path), init_reference_model=False)
    _train(adamw, range(1))
    ck.save_checkpoint(
        adamw.state, tmp_path / "weights", tmp_path / "optimizer", is_final_checkpoint=True
    )
    worker = _worker(path)
    before = _optimizer_state(worker)
    with pytest.raises(ValueError, match="saved by another optimizer than this worker's Adafactor"):
        ck.load_checkpoint(worker.state, tmp_path / "weights", tmp_path / "optimizer")
    _assert_same_state(_optimizer_state(worker), before)


def test_offload_around_a_rollout_keeps_the_state_and_the_next_step(tiny_model_paths):
    """The calls of a colocated rollout between two train steps leave the factored state as it
    was, and the next step equals one taken without them."""
    path = tiny_model_paths["qwen3"]
    kept, moved = _worker(path), _worker(path, offload_optimizer_for_logprob=True)
    _train(kept, range(2))
    _train(moved, range(2))
    before = _optimizer_state(moved)
    moved.offload_before_refit()
    moved.offload_after_refit()
    moved.prepare_for_lp_inference()
    moved.get_logprobs(make_batch(4, 10, seed=7))
    moved.finish_inference()
    moved.prepare_for_training()
    _assert_same_state(_optimizer_state(moved), before)
    _train(kept, range(2, 3))
    _train(moved, range(2, 3))
    _assert_same_state(_optimizer_state(moved), _optimizer_state(kept))
    want, got = _weights(kept), _weights(moved)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_refit_after_adafactor_steps_delivers_the_trained_weights(tiny_model_paths):
    path = tiny_model_paths["qwen2"]
    worker = _worker(path)
    _train(worker, range(2))
    worker.offload_before_refit()
    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trained = worker.model.state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in target.state_dict().items())
    receiver = HFWeightReceiver(
        target,
        address=worker.get_zmq_address(),
        refit_info=worker.prepare_refit_info(),
        timeout_s=30,
    )
    try:
        report, box = refit_through(worker, receiver)
    finally:
        receiver.close()
    assert "error" not in box, box
    assert report is not None and report["version"] == 1
    got = target.state_dict()
    for name, tensor in worker.model.state_dict().items():
        assert torch.equal(got[name], tensor), name


def _docs_section() -> str:
    text = (pathlib.Path(__file__).parents[3] / "docs" / "memory.md").read_text()
    return text[text.index("## Full fine-tuning of a 7B shape on one GPU") :]


def _plan_7b(policy: dict) -> dict[str, float]:
    """The planner's GiB per phase of `policy` on the Qwen2.5-7B shape, as on CUDA with
    `fusion: auto` (layers compiled, fused logprob kernels)."""
    cfg = load_config(policy)
    hf_config = transformers.Qwen2Config()
    hf_config.update(QWEN25_7B)
    shape = memory_calls.shape_from_hf_config(hf_config)
    knobs = memory_calls.knobs_from_config(
        cfg, device=torch.device("cpu"), fused_logprobs=True, compiled_layers=True
    )
    return {p.phase: p.total / 2**30 for p in plan_memory(shape, knobs).phases}


def test_the_docs_7b_config_fits_an_h200_and_adamw_in_its_place_does_not():
    section = _docs_section()
    start = section.index("```yaml") + len("```yaml")
    block = section[start : section.index("```", start)]
    policy = yaml.safe_load(block)["policy"]
    budget = 139 - 2  # an H200's memory less the pre-flight's reserve
    adafactor = _plan_7b(policy)
    assert max(adafactor.values()) <= budget
    adamw = _plan_7b({**policy, "optimizer": {"name": "torch.optim.AdamW", "kwargs": {}}})
    assert adamw["optimizer_step"] > budget and adamw["train_step"] > budget
    for name, plan in (("AdamW", adamw), ("Adafactor", adafactor)):
        row = f"| `torch.optim.{name}` |"
        line = next(x for x in section.splitlines() if x.startswith(row))
        cells = [c.strip(" *") for c in line.split("|")]
        assert cells[-3:-1] == [f"{plan['train_step']:.1f}", f"{plan['optimizer_step']:.1f}"]

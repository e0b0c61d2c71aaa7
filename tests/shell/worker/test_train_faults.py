"""A train() call that raises part-way: the steps it applied keep their scheduler step, and the
gradients are freed."""

from __future__ import annotations

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config


class _RaisesAtCall(NLLLoss):
    """NLL that raises at its call number `bad` (0-based; gbs 4 and mbs 2 below make calls 0-1
    global batch 1 and calls 2-3 global batch 2)."""

    def __init__(self, bad: int) -> None:
        self.calls, self.bad = 0, bad

    def __call__(self, data, global_valid_seqs, global_valid_toks, **inputs):
        if self.calls == self.bad:
            raise RuntimeError(f"the loss failed at call {self.bad}")
        self.calls += 1
        return super().__call__(data, global_valid_seqs, global_valid_toks, **inputs)


@pytest.fixture
def worker(tiny_model_paths):
    cfg = make_config(
        tiny_model_paths["llama"],
        scheduler={
            "name": "torch.optim.lr_scheduler.StepLR",
            "kwargs": {"step_size": 1, "gamma": 0.5},
        },
    )
    return PolicyWorker(cfg, init_reference_model=False)


def test_a_loss_raising_in_global_batch_two_keeps_batch_one_step_and_its_scheduler_step(worker):
    before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    data = make_batch(8, 10, seed=41)  # gbs 4, mbs 2: two global batches of two microbatches
    with pytest.raises(RuntimeError, match="the loss failed"):
        worker.train(data, _RaisesAtCall(3))
    after = worker.model.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in before.items())  # batch 1 stepped
    assert worker.optimizer.state_dict()["state"]  # and the optimizer holds its moments
    # the LR schedule follows the optimizer: as after a successful call that stepped
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(0.005)


def test_a_loss_raising_in_the_first_global_batch_leaves_the_schedule_alone(worker):
    with pytest.raises(RuntimeError, match="the loss failed"):
        worker.train(make_batch(8, 10, seed=42), _RaisesAtCall(1))
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


@pytest.mark.parametrize("bad", [1, 3])
def test_gradients_are_freed_when_train_raises(worker, bad):
    with pytest.raises(RuntimeError, match="the loss failed"):
        worker.train(make_batch(8, 10, seed=43), _RaisesAtCall(bad))
    # the microbatch before the failing one ran backward: its gradients were allocated
    assert all(p.grad is None for p in worker.model.parameters())


def test_train_works_again_after_a_failed_call(worker):
    with pytest.raises(RuntimeError):
        worker.train(make_batch(8, 10, seed=44), _RaisesAtCall(3))
    result = worker.train(make_batch(4, 10, seed=45), NLLLoss())
    assert result["skipped_steps"] == 0 and result["grad_norm"] > 0
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(0.0025)


def test_a_row_over_the_token_budget_in_global_batch_two_is_refused_before_any_step(
    tiny_model_paths,
):
    cfg = make_config(
        tiny_model_paths["llama"],
        dynamic_batching={"train_mb_tokens": 8, "sequence_length_round": 4},
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    data = make_batch(8, 10, seed=46, lengths=[8, 6, 8, 4, 10, 3, 5, 5])  # row 4: width 12 > 8
    with pytest.raises(ValueError, match="row 0 has length 10 .* > max_tokens 8"):
        worker.train(data, NLLLoss())
    after = worker.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not worker.optimizer.state_dict()["state"]

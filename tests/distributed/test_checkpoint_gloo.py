"""Checkpoints across layouts on gloo: dp1 -> dp2 -> tp2 -> dp1, exact at every hop."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from policyworker.functional.loss import NLLLoss
from policyworker.shell import checkpoint as ck
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.distributed import checkpoint_workers as workers
from tests.distributed.launch import run_on_gloo
from tests.shell.conftest import make_batch, make_config, save_tiny

pytestmark = pytest.mark.distributed


def _single_state(worker) -> dict:
    return {
        "weights": {k: v.detach().clone() for k, v in worker.model.state_dict().items()},
        "optim": {
            fqn: {k: v.clone() for k, v in state.items()}
            for fqn, state in get_optimizer_state_dict(worker.model, worker.optimizer)[
                "state"
            ].items()
        },
        "scheduler": worker.scheduler.state_dict(),
        "reference": dict(worker._reference_state),
    }


def _config(path):
    return make_config(
        path,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
        scheduler={
            "name": "torch.optim.lr_scheduler.StepLR",
            "kwargs": {"step_size": 1, "gamma": 0.7},
        },
    )


def test_checkpoints_round_trip_exactly_between_dp1_dp2_and_tp2(tmp_path):
    torch.manual_seed(0)
    save_tiny(tmp_path / "llama")
    path = str(tmp_path / "llama")
    single = PolicyWorker(_config(path))
    single.train(make_batch(4, 10, seed=1), NLLLoss())
    ck.save_checkpoint(
        single.state,
        tmp_path / "dp1" / "weights",
        tmp_path / "dp1" / "optimizer",
        is_final_checkpoint=True,
    )
    torch.save(_single_state(single), tmp_path / "dp1_full.pt")

    run_on_gloo(workers.load_save_across_layouts, 2, path, str(tmp_path))

    for layout in ("dp2", "tp2"):
        fresh = PolicyWorker(_config(path))
        ck.load_checkpoint(
            fresh.state, tmp_path / layout / "weights", tmp_path / layout / "optimizer"
        )
        workers.assert_same_state(
            _single_state(fresh), torch.load(tmp_path / f"{layout}_full.pt", weights_only=False)
        )

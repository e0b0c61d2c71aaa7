"""Rank bodies for tests/distributed/test_checkpoint_gloo.py (module level: fork/spawn run them)."""

from __future__ import annotations

import copy
import pathlib

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from policyworker.shell import checkpoint as ck
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.parallel.plans import parallelize_model


class ShardedWorker:
    """The attributes the checkpoint functions read, around an FSDP2 / TP model."""

    def __init__(self, model_path: str, *, tp_size: int) -> None:
        import transformers

        self.parallel = ParallelContext.from_environment(tp_size=tp_size, timeout_s=60.0)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model = parallelize_model(model, self.parallel, precision=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.7)
        self.tokenizer = None
        self.cfg = None
        self._reference_state = {k: _local(v).clone() for k, v in self.model.state_dict().items()}
        self.saver = ck.AsyncSaver()

    @property
    def reference_state(self) -> dict | None:  # the name CheckpointOwner reads
        return self._reference_state

    def train_step(self) -> None:
        import contextlib

        from torch.distributed.tensor.parallel import loss_parallel

        ids = torch.arange(24).reshape(2, 12) % 100 + 3
        vocab_parallel = self.parallel.tp_size > 1  # logits arrive sharded on the vocab dim
        with loss_parallel() if vocab_parallel else contextlib.nullcontext():
            self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_training_state(worker) -> dict:
    """Full weights, full optimizer state (by FQN), scheduler and full reference (collective)."""
    weights = {k: _full(v).clone() for k, v in worker.model.state_dict().items()}
    optim = get_optimizer_state_dict(
        worker.model, worker.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    ref = {}
    live = worker.model.state_dict()
    for k, v in worker._reference_state.items():
        if hasattr(live[k], "device_mesh"):
            from torch.distributed.tensor import DTensor

            v = DTensor.from_local(
                v,
                live[k].device_mesh,
                live[k].placements,
                run_check=False,
                shape=live[k].shape,
                stride=live[k].stride(),
            ).full_tensor()
        ref[k] = v.clone()
    optim_state = {
        fqn: {k: _full(v).clone() for k, v in state.items()}
        for fqn, state in optim["state"].items()
    }
    return {
        "weights": weights,
        "optim": optim_state,
        "scheduler": copy.deepcopy(worker.scheduler.state_dict()),
        "reference": ref,
    }


def assert_same_state(got: dict, want: dict) -> None:
    for part in ("weights", "reference"):
        assert got[part].keys() == want[part].keys(), part
        for k in want[part]:
            assert torch.equal(got[part][k], want[part][k]), f"{part} {k}"
    assert got["optim"].keys() == want["optim"].keys()
    for fqn, state in want["optim"].items():
        for k, v in state.items():
            assert torch.equal(_full(got["optim"][fqn][k]), _full(v)), f"optim {fqn}.{k}"
    assert got["scheduler"] == want["scheduler"]


def load_save_across_layouts(rank: int, world_size: int, model_path: str, root: str) -> None:
    """dp1 checkpoint -> dp2 load (exact); dp2 step + async save; dp2 save -> tp2 load; tp2 save."""
    root_path = pathlib.Path(root)
    dp1 = torch.load(root_path / "dp1_full.pt", weights_only=False)
    dp2 = ShardedWorker(model_path, tp_size=1)
    assert dp2.parallel.dp_size == 2
    ck.load_checkpoint(dp2, root_path / "dp1" / "weights", root_path / "dp1" / "optimizer")
    assert_same_state(full_training_state(dp2), dp1)
    dp2.train_step()
    ck.save_checkpoint(dp2, root_path / "dp2" / "weights", root_path / "dp2" / "optimizer")
    saved = full_training_state(dp2)
    dp2.train_step()  # the async writer must have staged the pre-step state
    ck.finalize_async_save(dp2)
    if rank == 0:
        torch.save(saved, root_path / "dp2_full.pt")
    tp2 = ShardedWorker(model_path, tp_size=2)
    assert tp2.parallel.tp_size == 2
    ck.load_checkpoint(tp2, root_path / "dp2" / "weights", root_path / "dp2" / "optimizer")
    assert_same_state(full_training_state(tp2), saved)
    tp2.train_step()
    ck.save_checkpoint(
        tp2,
        root_path / "tp2" / "weights",
        root_path / "tp2" / "optimizer",
        is_final_checkpoint=True,
    )
    saved_tp = full_training_state(tp2)
    if rank == 0:
        torch.save(saved_tp, root_path / "tp2_full.pt")

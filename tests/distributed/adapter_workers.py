"""Per-rank bodies of the several-adapter gloo test (module-level, so forked ranks run them)."""

from __future__ import annotations

import torch

LORA = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 4, "alpha": 8}


def _worker(path: str, tp_size: int, **lora: object):
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_config

    torch.manual_seed(0)
    cfg = make_config(
        path,
        train_micro_batch_size=1,
        dtensor_cfg={"tensor_parallel_size": tp_size, "lora_cfg": {**LORA, **lora}},
    )
    return PolicyWorker(cfg, init_reference_model=False)


def adapters_equal_single_workers(rank: int, world_size: int, path: str) -> None:
    """On dp2 (FSDP2-sharded adapters) and tp2 (TP-sharded adapters): two adapters trained
    alternately on one worker equal two single-adapter workers, bit for bit (the same sharded
    ops on the same values in the same order)."""
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.model.lora import lora_state_dict
    from tests.shell.conftest import make_batch

    for tp_size in (1, 2):
        both = _worker(path, tp_size, adapters=["a", "b"])
        alone = {"a": _worker(path, tp_size), "b": _worker(path, tp_size)}
        for step in range(2):
            for i, name in enumerate(("a", "b")):
                data = make_batch(4, 10, seed=10 * step + i)
                rows = slice(rank * 2, rank * 2 + 2) if tp_size == 1 else slice(None)
                local = {k: v[rows] for k, v in data.items()}
                got = both.train(local, NLLLoss(), adapter=name)["global_loss"]
                want = alone[name].train(local, NLLLoss())["global_loss"]
                assert torch.equal(got, want), (tp_size, step, name)
        for name, single in alone.items():
            both.select_adapter(name)
            mine, theirs = lora_state_dict(both.model), lora_state_dict(single.model)
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs), (tp_size, name)
        for worker in (both, *alone.values()):
            worker.shutdown()

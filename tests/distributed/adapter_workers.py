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
    ops on the same values in the same order); an adapter-only refit sends the full adapter."""
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
        _check_adapter_refit(both)
        for worker in (both, *alone.values()):
            worker.shutdown()


def _check_adapter_refit(worker) -> None:
    """Rank 0 receives an adapter-only refit of the sharded worker in a thread: the full
    adapter tensors of the active adapter, under PEFT's names."""
    import threading

    import torch.distributed as dist

    from policyworker.functional.lora import to_peft_key
    from policyworker.shell.model.lora import lora_state_dict
    from policyworker.shell.refit.receiver import HFWeightReceiver

    info = worker.prepare_refit_info(adapter_only=True)
    want = {to_peft_key(k): v for k, v in lora_state_dict(worker.model).items()}  # gathers
    assert set(info) == set(want)
    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    thread = receiver = None
    if dist.get_rank() == 0:
        receiver = HFWeightReceiver(
            lambda pairs: got.update({n: t.clone() for n, t in pairs}),
            address=worker.get_zmq_address(),
            refit_info=info,
            timeout_s=60.0,
        )

        def serve() -> None:
            try:
                receiver.receive()
            except Exception as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
    report = worker.stream_weights_via_ipc_zmq(timeout_s=60.0, adapter_only=True)
    assert (report is None) == (dist.get_rank() != 0), report
    if thread is not None and receiver is not None:
        thread.join(60)
        receiver.close()
        assert not errors, errors
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

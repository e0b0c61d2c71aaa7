"""Per-rank bodies of the MoE gloo tests (module-level, so forked ranks can run them)."""

from __future__ import annotations

import torch

RATE = 0.01
LENGTHS = (12, 11, 3, 2)  # rank 1 gets the short rows: under packing it runs a dummy microbatch
BATCHINGS = {"fixed": {}, "packed": {"sequence_packing": {"train_mb_tokens": 16}}}


def moe_config(path, batching):
    from tests.shell.conftest import make_config

    return make_config(
        path,
        train_global_batch_size=4,
        train_micro_batch_size=1,
        router_replay={},
        dtensor_cfg={"moe_router_bias_update_rate": RATE},
        **BATCHINGS[batching],
    )


def moe_data(routes=None):
    from tests.shell.conftest import make_batch

    data = make_batch(4, 12, seed=7, lengths=LENGTHS)
    if routes is not None:
        data["routed_experts"] = routes
    return data


def moe_reference(path):
    """One process: the model's own routes, replayed logprobs, one step's loads and biases."""
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.helpers import own_moe_routes

    worker = PolicyWorker(moe_config(path, "fixed"))
    data = moe_data()
    routes = own_moe_routes(worker.model, worker.state.moe.routers, data)
    data["routed_experts"] = routes
    out = {"routes": routes, "logprobs": worker.get_logprobs(data)["logprobs"]}
    worker.train(data, NLLLoss())
    out["load"] = dict(worker.state.moe.last_step_load)
    out["bias"] = {r.name: r.bias.clone() for r in worker.state.moe.routers if r.bias is not None}
    worker.shutdown()
    return out


def moe_dp2(rank, size, path, want):
    """dp2: replayed logprobs match one process; the step's loads are summed over both ranks
    (every microbatch, no dummy) and both ranks move the bias exactly as one process does."""
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.worker import microbatches as mbatch
    from policyworker.shell.worker.policy_worker import PolicyWorker

    data = moe_data(want["routes"])
    rows = slice(rank * 2, rank * 2 + 2)
    shard = {k: v[rows] for k, v in data.items()}
    for batching in BATCHINGS:
        worker = PolicyWorker(moe_config(path, batching))
        assert worker.parallel.dp_size == size == 2
        dummies = sum(
            p.is_dummy
            for p in mbatch.plan(
                worker.state, shard["input_lengths"], seq_len=12, mbs=1, purpose="train"
            )
        )
        assert (dummies > 0) == (batching == "packed" and rank == 1), (batching, rank, dummies)
        got = worker.get_logprobs(shard)["logprobs"]
        torch.testing.assert_close(got, want["logprobs"][rows], atol=1e-5, rtol=1e-5)
        worker.train(shard, NLLLoss())
        local_tokens = int(shard["input_lengths"].sum()) * 2
        for name, load in want["load"].items():
            assert int(load.sum()) == sum(LENGTHS) * 2 != local_tokens
            assert torch.equal(worker.state.moe.last_step_load[name], load), (batching, rank, name)
        for router in worker.state.moe.routers:
            assert router.bias.dtype == torch.float32
            assert torch.equal(router.bias, want["bias"][router.name]), (batching, router.name)
        worker.shutdown()

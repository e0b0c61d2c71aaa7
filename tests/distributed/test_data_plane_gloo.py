"""Fetch policies on a tp2 worker (2 gloo ranks, CPU, no Ray): only rank 0's in-process store
holds the rows, so a rank that reads by itself finds nothing there.

`leader_broadcast` (and `auto`) read on rank 0 only and broadcast a descriptor, then the tensors:
both ranks get the plain call's logprobs bitwise, and only rank 0 writes the result back.
`independent` makes rank 1 read its own empty store: both ranks refuse together, naming the
rows, and the group works afterwards. A leader that cannot read sends its error in the
descriptor, so its peer raises the same error instead of waiting.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_on_gloo
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.distributed

FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


def fetch_policies_tp2(rank: int, size: int, path: str) -> None:
    from policyworker.functional.receipts import KVBatchMeta
    from policyworker.shell.data_plane.client import DataPlaneError
    from policyworker.shell.data_plane.in_process import InProcessDataPlane
    from policyworker.shell.parallel.agreed_checks import PeerRefusedError
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.distributed import workers

    worker = PolicyWorker(workers._worker_config(path, tp_size=2))
    data = workers._worker_data()
    keys = [f"k{i}" for i in range(4)]
    store = InProcessDataPlane()
    meta = KVBatchMeta(partition_id="p", sample_ids=keys, fields=FIELDS)
    if rank == 0:
        store.put_samples(keys, "p", {k: data[k] for k in FIELDS})
    want = worker.get_logprobs(data)["logprobs"]

    for policy in ("leader_broadcast", "auto"):
        worker.setup_data_plane(
            {"enabled": True, "impl": "in_process", "fetch_policy": policy}, client=store
        )
        worker.get_logprobs_presharded(meta)
        if rank == 0:
            got = store.get_samples(keys, "p", ["prev_logprobs"])["prev_logprobs"]
            assert torch.equal(got, want), policy
        else:
            with pytest.raises(DataPlaneError, match="'p' is not in the data plane"):
                store.get_samples(keys, "p", ["prev_logprobs"])  # the leader alone writes

    worker.setup_data_plane({"enabled": True, "impl": "in_process", "fetch_policy": "independent"})
    with pytest.raises((DataPlaneError, PeerRefusedError)) as refused:
        worker.get_logprobs_presharded(meta)
    assert "'p' is not in the data plane" in str(refused.value)

    worker.setup_data_plane(
        {"enabled": True, "impl": "in_process", "fetch_policy": "leader_broadcast"}
    )
    ghost = KVBatchMeta(partition_id="p", sample_ids=["ghost"], fields=FIELDS)
    with pytest.raises(DataPlaneError, match=r"no rows for sample_ids \['ghost'\]") as err:
        worker.get_logprobs_presharded(ghost)
    if rank == 1:
        assert "leader (rank 0) could not fetch" in str(err.value)
    assert torch.equal(worker.get_logprobs(data)["logprobs"], want)  # the group still works


def test_fetch_policies_on_a_tp2_replica_group(tmp_path):
    run_on_gloo(fetch_policies_tp2, 2, save_tiny_llama(tmp_path))


def split_step_dp2(rank: int, size: int, path: str) -> None:
    from policyworker.functional.loss import NLLLoss
    from policyworker.functional.receipts import KVBatchMeta, shard_receipt
    from policyworker.shell.data_plane.in_process import InProcessDataPlane
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.distributed import workers

    plain = PolicyWorker(workers._worker_config(path, tp_size=1))
    pre = PolicyWorker(workers._worker_config(path, tp_size=1))
    data = workers._worker_data()
    mask = torch.zeros_like(data["token_mask"])
    mask[:, 1] = 1.0  # one token per row (the shortest has 2): 4, a power of two
    data["token_mask"] = mask
    fields = (*FIELDS, "advantages", "prev_logprobs", "generation_logprobs")
    keys = [f"k{i}" for i in range(4)]
    store = InProcessDataPlane()  # every rank's copy holds the batch, as a shared store would
    store.put_samples(keys, "p", {k: data[k] for k in fields})
    pre.setup_data_plane({"enabled": True, "impl": "in_process"}, client=store)
    mine = shard_receipt(
        KVBatchMeta(partition_id="p", sample_ids=keys, fields=fields), dp_size=size, dp_rank=rank
    )
    local = {k: v[2 * rank : 2 * rank + 2] for k, v in data.items()}
    for _ in range(2):
        pre.begin_train_step_presharded(NLLLoss(), gbs=4, mbs=1)
        for row in range(mine.size):
            pre.train_microbatch_presharded(mine.subset([row]))
        got = pre.finish_train_step_presharded()
        want = plain.train(local, NLLLoss(), gbs=4, mbs=1)
        assert torch.equal(got["global_loss"], torch.as_tensor(want["global_loss"]))
        assert got["grad_norm"] == want["grad_norm"]
        assert got["all_mb_metrics"]["global_valid_toks"] == [4.0, 4.0]
    got_params, want_params = workers._worker_params(pre), workers._worker_params(plain)
    assert all(torch.equal(got_params[n], want_params[n]) for n in want_params)


def test_split_presharded_train_step_on_dp2_equals_train_bitwise(tmp_path):
    run_on_gloo(split_step_dp2, 2, save_tiny_llama(tmp_path))

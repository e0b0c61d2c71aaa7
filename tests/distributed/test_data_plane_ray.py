"""Presharded calls over the real TransferQueue on one local Ray cluster (CPU, gloo).

One Ray cluster and one TransferQueue (started by the driver, `bootstrap=True`) for the module.
A worker in the driver process attaches to it: its presharded logprobs, written back as
`prev_logprobs`, read by key equal the plain call bitwise (fp32); receipts naming absent keys,
absent fields or cleared rows are refused naming them, with the weights unchanged. A dp2 group
of Ray actors fetches its shards itself: logprobs, reference logprobs and an eval-mode train
equal the plain group calls bitwise. A tp2 group (one replica group of two ranks) gets the same
logprobs under `independent` and `leader_broadcast`.
"""

from __future__ import annotations

import pickle

import pytest
import ray
import torch

from policyworker.config.sections import DataPlaneConfig
from policyworker.functional.loss import NLLLoss
from policyworker.functional.receipts import KVBatchMeta
from policyworker.shell.data_plane.build import build_client
from policyworker.shell.data_plane.client import DataPlaneError
from tests.distributed import workers
from tests.shell.conftest import make_batch, make_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TQ = {"enabled": True, "impl": "transfer_queue"}
FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")
TRAIN_FIELDS = (*FIELDS, "advantages", "prev_logprobs", "generation_logprobs")
CALL_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def client():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    dp = build_client(DataPlaneConfig(impl="transfer_queue"), bootstrap=True)
    yield dp
    dp.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from tests.helpers import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("dp_llama"))


def _put(client, partition, data, fields=FIELDS) -> KVBatchMeta:
    keys = [f"{partition}-{i}" for i in range(data["input_ids"].shape[0])]
    meta = client.put_samples(keys, partition, {k: data[k] for k in fields})
    lengths = data["input_lengths"].tolist()
    return KVBatchMeta(
        partition_id=partition, sample_ids=keys, fields=meta.fields, sequence_lengths=lengths
    )


def test_driver_worker_write_back_is_readable_by_key_and_bad_receipts_are_refused(
    client, llama_path
):
    from policyworker.shell.worker.policy_worker import PolicyWorker

    worker = PolicyWorker(make_config(llama_path))
    worker.setup_data_plane(TQ)  # attaches to the driver's TransferQueue
    data = make_batch(4, 10, seed=11)
    meta = _put(client, "driver", data)
    worker.get_logprobs_presharded(meta, micro_batch_size=2)
    back = client.get_samples(list(reversed(meta.sample_ids)), "driver", ["prev_logprobs"])
    want = worker.get_logprobs(data, 2)["logprobs"]
    assert torch.equal(back["prev_logprobs"], want.flip(0))

    before = [p.detach().clone() for p in worker.model.parameters()]
    ghost = KVBatchMeta(
        partition_id="driver", sample_ids=["ghost", *meta.sample_ids[1:]], fields=FIELDS
    )
    with pytest.raises(DataPlaneError, match=r"no rows for sample_ids \['ghost'\]"):
        worker.train_presharded(ghost, NLLLoss())
    with pytest.raises(DataPlaneError, match=r"no field\(s\) \['advantages'\]"):
        worker.train_presharded(meta.with_fields(["advantages"]), NLLLoss())
    with pytest.raises(DataPlaneError, match="'nowhere' is not in the data plane"):
        worker.train_presharded(
            KVBatchMeta(partition_id="nowhere", sample_ids=["a"], fields=FIELDS), NLLLoss()
        )
    client.clear_samples(meta.sample_ids, "driver")
    with pytest.raises(DataPlaneError, match="never put, or were cleared"):
        worker.get_logprobs_presharded(meta)
    assert all(torch.equal(a, b) for a, b in zip(before, worker.model.parameters(), strict=True))


def _group(path, *, tp_size):
    from policyworker.shell.ray import RayWorkerGroup

    cfg = workers._worker_config(path, tp_size=tp_size)
    return RayWorkerGroup(
        cfg, num_workers=2, torch_threads=1, timeout_s=CALL_TIMEOUT_S, collective_timeout_s=60.0
    )


def test_dp2_presharded_calls_equal_the_plain_group_calls(client, llama_path):
    import policyworker.shell.ray.data_plane as rdp

    data = workers._worker_data()
    meta = _put(client, "dp2", data, TRAIN_FIELDS)
    assert len(pickle.dumps(meta)) < sum(data[k].nbytes for k in TRAIN_FIELDS)
    with _group(llama_path, tp_size=1) as group:
        rdp.setup_data_plane(group, TQ)
        back = rdp.get_logprobs_presharded(group, meta.with_fields(FIELDS).subset(range(4)))
        lp = rdp.read_fields(client, back, ["prev_logprobs"])["prev_logprobs"]
        assert torch.equal(lp, group.get_logprobs(data)["logprobs"])
        ref_meta = rdp.get_reference_policy_logprobs_presharded(group, meta)
        ref = rdp.read_fields(client, ref_meta, ["reference_policy_logprobs"])
        want_ref = group.get_reference_policy_logprobs(data)["reference_logprobs"]
        assert torch.equal(ref["reference_policy_logprobs"], want_ref)
        # prev_logprobs now hold the fresh logprobs: train on the same rows both ways (eval)
        data = {**data, "prev_logprobs": lp}
        got = rdp.train_presharded(group, meta, NLLLoss(), eval_mode=True)
        want = group.train(data, NLLLoss(), eval_mode=True)
        assert torch.equal(
            torch.as_tensor(got["global_loss"]), torch.as_tensor(want["global_loss"])
        )
        trained = rdp.train_presharded(group, meta, NLLLoss())
        assert torch.isfinite(torch.as_tensor(trained["grad_norm"])).all()


@pytest.mark.parametrize("policy", ["independent", "leader_broadcast"])
def test_tp2_fetch_policies_give_the_plain_logprobs(client, llama_path, policy):
    import policyworker.shell.ray.data_plane as rdp

    data = workers._worker_data()
    meta = _put(client, f"tp2-{policy}", data)
    with _group(llama_path, tp_size=2) as group:
        rdp.setup_data_plane(group, {**TQ, "fetch_policy": policy})
        back = rdp.get_logprobs_presharded(group, meta)
        lp = rdp.read_fields(client, back, ["prev_logprobs"])["prev_logprobs"]
        assert torch.equal(lp, group.get_logprobs(data)["logprobs"])
        ghost = KVBatchMeta(partition_id=meta.partition_id, sample_ids=["ghost"], fields=FIELDS)
        with pytest.raises(Exception, match="ghost"):
            rdp.get_logprobs_presharded(group, ghost)
        assert torch.equal(lp, group.get_logprobs(data)["logprobs"])  # the group still works


def test_dp2_split_train_step_equals_the_plain_group_train(client, llama_path):
    import policyworker.shell.ray.data_plane as rdp

    data = workers._worker_data()
    mask = torch.zeros_like(data["token_mask"])
    mask[:, 1] = 1.0  # 4 counted tokens: dividing by a power of two is exact, so bitwise
    data["token_mask"] = mask
    meta = _put(client, "split", data, TRAIN_FIELDS)
    with _group(llama_path, tp_size=1) as plain:  # one group at a time on the 4-CPU cluster
        want = plain.train(data, NLLLoss(), gbs=4, mbs=1)
        want_lp = plain.get_logprobs(data)["logprobs"]
    with _group(llama_path, tp_size=1) as group:
        rdp.setup_data_plane(group, TQ)
        rdp.begin_train_step_presharded(group, NLLLoss(), gbs=4, mbs=1)
        for rows in ([0, 2], [1, 3]):  # each piece: one row per dp rank, rank 0 gets 0 then 1
            rdp.train_microbatch_presharded(group, meta.subset(rows))
        got = rdp.finish_train_step_presharded(group)
        assert torch.equal(got["global_loss"], torch.as_tensor(want["global_loss"]))
        assert got["grad_norm"] == want["grad_norm"]
        assert got["all_mb_metrics"]["loss"] == want["all_mb_metrics"]["loss"]
        assert torch.equal(group.get_logprobs(data)["logprobs"], want_lp)  # the same weights


def test_rows_put_at_different_widths_come_back_zero_padded(client):
    wide, narrow = make_batch(2, 10, seed=15), make_batch(2, 6, seed=16)
    client.put_samples(["w0", "w1"], "widths", {k: wide[k] for k in FIELDS})
    client.put_samples(["n0", "n1"], "widths", {k: narrow[k] for k in FIELDS})
    got = client.get_samples(["n0", "w0"], "widths", ["input_ids", "token_mask"])
    assert got["input_ids"].shape == (2, 10)
    assert torch.equal(got["input_ids"][0, :6], narrow["input_ids"][0])
    assert not got["input_ids"][0, 6:].any() and not got["token_mask"][0, 6:].any()
    assert torch.equal(got["input_ids"][1], wide["input_ids"][0])

"""Presharded calls over the in-process data plane (CPU, one rank): equal to the plain calls on
the same rows, bitwise in fp32, and every bad receipt refused before anything is trained."""

import copy

import pytest
import torch

from policyworker.errors import ConfigError
from policyworker.functional.loss import NLLLoss
from policyworker.functional.receipts import KVBatchMeta
from policyworker.shell.data_plane.client import DataPlaneError
from policyworker.shell.data_plane.in_process import InProcessDataPlane
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config

DP = {"enabled": True, "impl": "in_process"}
FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


def _worker(path, **overrides):
    return PolicyWorker(make_config(path, **overrides))


def _store_with(data, keys, fields=FIELDS):
    store = InProcessDataPlane()
    store.register_partition("train", list(fields), len(keys))
    return store, store.put_samples(keys, "train", {k: data[k] for k in fields})


BATCHING = {
    "fixed": {},
    "packed": {"sequence_packing": {"train_mb_tokens": 24}},
    "dynamic": {"dynamic_batching": {"train_mb_tokens": 24, "sequence_length_round": 4}},
}


@pytest.fixture(params=sorted(BATCHING))
def pair(request, tiny_model_paths):
    """Two identical fresh workers (one for the plain call, one presharded) and a batch; the
    microbatches of packing / dynamic batching are planned on the fetched rows."""
    path, extra = tiny_model_paths["llama"], BATCHING[request.param]
    return _worker(path, **extra), _worker(path, **extra), make_batch(4, 10, seed=5)


def test_presharded_logprobs_and_reference_equal_the_plain_calls_and_are_written_back(pair):
    plain, pre, data = pair
    keys = [f"s{i}" for i in range(4)]
    store, meta = _store_with(data, keys)
    pre.setup_data_plane(DP, client=store)
    assert pre.get_logprobs_presharded(meta, micro_batch_size=2) is None
    assert pre.get_reference_policy_logprobs_presharded(meta) is None

    want = plain.get_logprobs(data, 2)["logprobs"]
    want_ref = plain.get_reference_policy_logprobs(data)["reference_logprobs"]
    back = store.get_samples(keys, "train", ["prev_logprobs", "reference_policy_logprobs"])
    assert torch.equal(back["prev_logprobs"], want)
    assert torch.equal(back["reference_policy_logprobs"], want_ref)
    # readable by key, in any order
    two = store.get_samples(["s3", "s1"], "train", ["prev_logprobs"])["prev_logprobs"]
    assert torch.equal(two, want[[3, 1]])


def test_presharded_train_equals_the_plain_call_bitwise(pair):
    plain, pre, data = pair
    fields = (*FIELDS, "advantages", "prev_logprobs", "generation_logprobs")
    store, meta = _store_with(data, [f"s{i}" for i in range(4)], fields)
    pre.setup_data_plane(DP, client=store)
    got = pre.train_presharded(meta, NLLLoss(), gbs=4, mbs=2)
    want = plain.train(data, NLLLoss(), gbs=4, mbs=2)
    assert torch.equal(torch.as_tensor(got["global_loss"]), torch.as_tensor(want["global_loss"]))
    assert all(
        torch.equal(a, b)
        for a, b in zip(pre.model.parameters(), plain.model.parameters(), strict=True)
    )


def _params(worker):
    return [p.detach().clone() for p in worker.model.parameters()]


def test_bad_receipts_are_refused_naming_key_and_field_and_nothing_is_trained(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"])
    data = make_batch(4, 10, seed=6)
    keys = [f"s{i}" for i in range(4)]
    store, meta = _store_with(data, keys)
    before = _params(worker)

    with pytest.raises(DataPlaneError, match="setup_data_plane"):
        worker.train_presharded(meta, NLLLoss())
    worker.setup_data_plane(DP, client=store)

    ghost = KVBatchMeta(partition_id="train", sample_ids=[*keys[:3], "ghost"], fields=FIELDS)
    with pytest.raises(DataPlaneError, match=r"no rows for sample_ids \['ghost'\]"):
        worker.train_presharded(ghost, NLLLoss())
    no_adv = meta.with_fields(["advantages"])
    with pytest.raises(DataPlaneError, match=r"sample 's0'.*no field\(s\) \['advantages'\]"):
        worker.train_presharded(no_adv, NLLLoss())
    unnamed = KVBatchMeta(partition_id="train", sample_ids=keys)
    with pytest.raises(DataPlaneError, match="names no fields"):
        worker.get_logprobs_presharded(unnamed)
    with pytest.raises(DataPlaneError, match="KVBatchMeta receipt, got dict"):
        worker.get_logprobs_presharded(data)

    store.clear_samples(None, "train")
    with pytest.raises(DataPlaneError, match="partition 'train' is not in the data plane"):
        worker.get_logprobs_presharded(meta)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(worker), strict=True))
    with pytest.raises(DataPlaneError, match="not in the data plane"):
        store.get_samples(keys, "train", ["prev_logprobs"])


def test_setup_data_plane_checks_the_section_and_is_idempotent(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"])
    with pytest.raises(ConfigError, match="data_plane is not enabled"):
        worker.setup_data_plane()  # the policy config has no data_plane section
    with pytest.raises(ConfigError, match="bogus"):
        worker.setup_data_plane({**DP, "bogus": 1})
    with pytest.raises(ConfigError, match="fetch_policy"):
        worker.setup_data_plane({**DP, "fetch_policy": "leader"})
    worker.setup_data_plane({**DP, "fetch_policy": "independent"})
    first = worker._dp_client
    worker.setup_data_plane({**DP, "fetch_policy": "auto"}, client=InProcessDataPlane())
    assert worker._dp_client is first  # the client stays; the fetch policy is the new one
    assert worker._dp_config.fetch_policy == "auto"


def test_leader_broadcast_without_a_replica_group_is_refused(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"])
    data = make_batch(2, 6, seed=7)
    store, meta = _store_with(data, ["a", "b"])
    worker.setup_data_plane({**DP, "fetch_policy": "leader_broadcast"}, client=store)
    with pytest.raises(ValueError, match="leader_broadcast' needs a replica group"):
        worker.get_logprobs_presharded(meta)
    with pytest.raises(DataPlaneError, match="prev_logprobs"):
        store.get_samples(["a"], "train", ["prev_logprobs"])


def test_the_in_process_store_copies_rows_in_and_out(tiny_model_paths):
    data = make_batch(2, 6, seed=8)
    store, meta = _store_with(copy.deepcopy(data), ["a", "b"])
    got = store.get_data(meta)
    got["input_ids"].zero_()
    assert torch.equal(store.get_data(meta)["input_ids"], data["input_ids"])
    with pytest.raises(DataPlaneError, match="first dimension must be the number of sample_ids"):
        store.put_samples(["a"], "train", {"x": torch.zeros(2, 3)})


def _power_of_two_batch(seed):
    """Four rows whose loss counts 16 tokens: dividing by 16 is exact, so the split step's
    late division is bitwise what `train` does."""
    data = make_batch(4, 10, seed=seed, lengths=[10, 8, 7, 6])
    mask = torch.zeros(4, 10)
    mask[:, 1:5] = 1.0
    data["token_mask"] = mask
    return data


def _split_step(worker, meta, pieces, *, mbs):
    worker.begin_train_step_presharded(NLLLoss(), gbs=meta.size, mbs=mbs)
    for rows in pieces:
        assert worker.train_microbatch_presharded(meta.subset(rows)) is None
    return worker.finish_train_step_presharded()


def test_split_presharded_step_equals_train_bitwise(tiny_model_paths):
    path = tiny_model_paths["llama"]
    plain, pre = _worker(path), _worker(path)
    data = _power_of_two_batch(9)
    fields = (*FIELDS, "advantages", "prev_logprobs", "generation_logprobs")
    store, meta = _store_with(data, [f"s{i}" for i in range(4)], fields)
    pre.setup_data_plane(DP, client=store)
    for _ in range(2):  # the second step runs on updated weights and optimizer state
        got = _split_step(pre, meta, [[0, 1], [2, 3]], mbs=2)
        want = plain.train(data, NLLLoss(), gbs=4, mbs=2)
        assert torch.equal(got["global_loss"], torch.as_tensor(want["global_loss"]))
        assert got["grad_norm"] == want["grad_norm"]
        for key in ("loss", "global_valid_toks", "num_unmasked_tokens", "lr"):
            assert got["all_mb_metrics"][key] == want["all_mb_metrics"][key], key
        assert got["is_replica_leader"] and got["num_calls"] == 2
        assert all(
            torch.equal(a, b)
            for a, b in zip(pre.model.parameters(), plain.model.parameters(), strict=True)
        )
    assert pre.policy_version == plain.policy_version == 2


def test_split_step_with_any_count_matches_train_to_rounding(tiny_model_paths):
    path = tiny_model_paths["llama"]
    plain, pre = _worker(path), _worker(path)
    data = make_batch(4, 10, seed=10)  # a token count that is not a power of two
    pre.begin_train_step(NLLLoss(), gbs=4, mbs=1)
    for rows in ([0], [1, 2], [3]):
        pre.train_microbatch({k: v[rows] for k, v in data.items()})
    got = pre.finish_train_step()
    want = plain.train(data, NLLLoss(), gbs=4, mbs=1)
    torch.testing.assert_close(got["global_loss"], torch.as_tensor(want["global_loss"]))
    for a, b in zip(pre.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # Adam magnifies rounding near 0


def test_split_step_calls_out_of_order_and_bad_receipts_change_nothing(tiny_model_paths):
    from policyworker.shell.worker.split_step import TrainStepStateError

    worker = _worker(tiny_model_paths["llama"])
    data = _power_of_two_batch(11)
    fields = (*FIELDS, "advantages", "prev_logprobs", "generation_logprobs")
    store, meta = _store_with(data, [f"s{i}" for i in range(4)], fields)
    before = _params(worker)
    with pytest.raises(TrainStepStateError, match="begin_train_step"):
        worker.train_microbatch_presharded(meta)  # no step open (and no data plane yet)
    worker.begin_train_step_presharded(NLLLoss())
    with pytest.raises(DataPlaneError, match="setup_data_plane"):
        worker.train_microbatch_presharded(meta)
    worker.setup_data_plane(DP, client=store)
    with pytest.raises(TrainStepStateError, match="already open"):
        worker.begin_train_step_presharded(NLLLoss())
    ghost = KVBatchMeta(partition_id="train", sample_ids=["s0", "ghost"], fields=fields)
    with pytest.raises(DataPlaneError, match=r"no rows for sample_ids \['ghost'\]"):
        worker.train_microbatch_presharded(ghost)
    with pytest.raises(DataPlaneError, match=r"no field\(s\) \['reference_policy_logprobs'\]"):
        worker.train_microbatch_presharded(meta.with_fields(["reference_policy_logprobs"]))
    assert all(p.grad is None for p in worker.model.parameters())  # nothing ran backward
    worker.train_microbatch_presharded(meta)
    worker.abort_train_step_presharded()  # gradients dropped, no step
    with pytest.raises(TrainStepStateError, match="finish_train_step"):
        worker.finish_train_step_presharded()
    worker.abort_train_step_presharded()  # idempotent
    store.clear_samples(None, "train")
    worker.begin_train_step_presharded(NLLLoss())
    with pytest.raises(DataPlaneError, match="partition 'train' is not in the data plane"):
        worker.train_microbatch_presharded(meta)
    worker.abort_train_step_presharded()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(worker), strict=True))
    assert worker.policy_version == 0


def test_every_presharded_call_refuses_a_bad_receipt_before_any_change(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"])
    data = make_batch(4, 10, seed=12)
    keys = [f"s{i}" for i in range(4)]
    store, meta = _store_with(data, keys)
    before = _params(worker)
    calls = {
        "train": lambda m: worker.train_presharded(m, NLLLoss()),
        "logprobs": worker.get_logprobs_presharded,
        "reference": worker.get_reference_policy_logprobs_presharded,
    }
    for call in calls.values():
        with pytest.raises(DataPlaneError, match="setup_data_plane"):
            call(meta)
    worker.setup_data_plane(DP, client=store)
    empty = KVBatchMeta(partition_id="train", sample_ids=[], fields=FIELDS)
    unnamed = KVBatchMeta(partition_id="train", sample_ids=keys)
    for call in calls.values():
        with pytest.raises(DataPlaneError, match="names no sample_ids"):
            call(empty)
        with pytest.raises(DataPlaneError, match="names no fields"):
            call(unnamed)
        with pytest.raises(DataPlaneError, match=r"no field\(s\) \['advantages'\]"):
            call(meta.with_fields(["advantages"]))
    store.clear_samples(["s2"], "train")
    for call in calls.values():
        with pytest.raises(DataPlaneError, match=r"no rows for sample_ids \['s2'\]"):
            call(meta)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(worker), strict=True))
    written = store.get_samples(["s0"], "train", list(FIELDS))  # nothing was written back
    assert set(written) == set(FIELDS)
    for name in ("prev_logprobs", "reference_policy_logprobs"):
        with pytest.raises(DataPlaneError, match=name):
            store.get_samples(["s0"], "train", [name])


def test_rows_put_at_different_widths_are_fetched_zero_padded(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"])
    wide, narrow = make_batch(2, 10, seed=13), make_batch(2, 6, seed=14)
    store = InProcessDataPlane()
    store.put_samples(["w0", "w1"], "mix", {k: wide[k] for k in FIELDS})
    store.put_samples(["n0", "n1"], "mix", {k: narrow[k] for k in FIELDS})
    worker.setup_data_plane(DP, client=store)
    meta = KVBatchMeta(partition_id="mix", sample_ids=["n0", "w0", "n1", "w1"], fields=FIELDS)
    worker.get_logprobs_presharded(meta)

    def pad(t):
        return torch.nn.functional.pad(t, (0, 10 - t.shape[1])) if t.ndim == 2 else t

    rows = [0, 2, 1, 3]  # n0, w0, n1, w1 of cat(narrow, wide)
    padded = {k: torch.cat([pad(narrow[k]), wide[k]])[rows] for k in FIELDS}
    want = worker.get_logprobs(padded)["logprobs"]
    got = store.get_samples(meta.sample_ids, "mix", ["prev_logprobs"])["prev_logprobs"]
    assert got.shape == (4, 10) and torch.equal(got, want)

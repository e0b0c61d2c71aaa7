"""Properties of policyworker.functional.receipts (data-plane receipts, shards, fetch plans)."""

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.receipts import (
    FETCH_POLICIES,
    FetchPlan,
    KVBatchMeta,
    common_prefix,
    describe_tensors,
    empty_like_entries,
    missing,
    plan_fetch,
    receipt_problems,
    shard_receipt,
    stack_rows,
)

KEYS = st.lists(st.text("abcdef0123", min_size=1, max_size=6), unique=True, max_size=24)
NAMES = st.lists(st.sampled_from(["input_ids", "token_mask", "a", "b", "c"]), max_size=6)


def _meta(keys, lengths=None, fields=None) -> KVBatchMeta:
    return KVBatchMeta(
        partition_id="train", sample_ids=keys, sequence_lengths=lengths, fields=fields
    )


@given(KEYS, st.data())
def test_a_good_receipt_has_no_problems_and_survives_pickling(keys, data):
    lengths = data.draw(st.lists(st.integers(0, 99), min_size=len(keys), max_size=len(keys)))
    meta = _meta(keys, lengths, ("input_ids",))
    assert receipt_problems(meta) == []
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert meta.size == len(keys)


@given(KEYS.filter(bool), st.data())
def test_a_repeated_key_or_misaligned_lengths_is_refused_naming_the_key(keys, data):
    dup = data.draw(st.sampled_from(keys))
    with pytest.raises(ValueError, match=f"sample_ids repeat \\[{dup!r}\\]"):
        _meta([*keys, dup])
    with pytest.raises(ValueError, match="one length per row"):
        _meta(keys, [1] * (len(keys) + 1))


@given(NAMES, NAMES)
def test_missing_is_the_ordered_set_difference(wanted, present):
    out = missing(wanted, present)
    assert set(out) == set(wanted) - set(present)
    assert list(out) == sorted(out, key=wanted.index)
    assert len(out) == len(set(out))


@given(st.integers(1, 6), st.integers(0, 5), st.data())
def test_shards_are_contiguous_equal_and_concatenate_to_the_batch(dp, per, data):
    keys = [f"k{i}" for i in range(dp * per)]
    lengths = data.draw(st.lists(st.integers(0, 50), min_size=len(keys), max_size=len(keys)))
    meta = _meta(keys, lengths, ("input_ids",))
    shards = [shard_receipt(meta, dp_size=dp, dp_rank=r) for r in range(dp)]
    assert [k for s in shards for k in s.sample_ids] == keys
    assert [n for s in shards for n in s.sequence_lengths] == lengths
    assert {s.size for s in shards} <= {per}
    assert all(s.fields == meta.fields and s.partition_id == "train" for s in shards)


@given(st.integers(2, 6), st.integers(1, 30))
def test_an_uneven_batch_is_refused(dp, n):
    if n % dp == 0:
        n += 1
    with pytest.raises(ValueError, match="not a multiple of dp_size"):
        shard_receipt(_meta([f"k{i}" for i in range(n)]), dp_size=dp, dp_rank=0)


@given(st.sampled_from(FETCH_POLICIES), st.integers(1, 8))
def test_exactly_one_rank_of_a_group_fetches_unless_independent(policy, size):
    if policy == "leader_broadcast" and size == 1:
        with pytest.raises(ValueError, match="more than one rank"):
            plan_fetch(policy, group_size=size, is_leader=True)
        return
    plans = [plan_fetch(policy, group_size=size, is_leader=r == 0) for r in range(size)]
    fetching = sum(p.fetch for p in plans)
    assert fetching == (size if policy == "independent" or size == 1 else 1)
    assert all(p.broadcast == (fetching < size) for p in plans)  # every unfetched rank receives
    assert all(p.fetch or p.broadcast for p in plans)


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'leader'.*'auto', 'independent', 'leader_broadcast'"):
        plan_fetch("leader", group_size=2, is_leader=True)
    assert plan_fetch("auto", group_size=1, is_leader=True) == FetchPlan(True, False)


DTYPES = st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool])


@given(
    st.dictionaries(
        st.sampled_from("xyzw"), st.tuples(DTYPES, st.lists(st.integers(0, 4), max_size=3))
    )
)
def test_a_descriptor_rebuilds_tensors_of_the_same_dtype_and_shape(spec):
    tensors = {k: torch.zeros(shape, dtype=dt) for k, (dt, shape) in spec.items()}
    entries = describe_tensors(tensors)
    assert pickle.loads(pickle.dumps(entries)) == entries  # small and picklable, no tensor data
    rebuilt = empty_like_entries(entries, device=torch.device("cpu"))
    assert rebuilt.keys() == tensors.keys()
    assert all(
        rebuilt[k].dtype == t.dtype and rebuilt[k].shape == t.shape for k, t in tensors.items()
    )


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 3)), min_size=1, max_size=5),
    st.sampled_from([torch.float32, torch.int64, torch.bool]),
)
def test_stacked_rows_keep_every_value_and_pad_with_zeros(shapes, dtype):
    rows = [
        torch.arange(w * k).reshape(w, k).remainder(5).to(dtype) + (dtype != torch.bool)
        for w, k in shapes
    ]
    out = stack_rows("f", rows)
    width, depth = max(w for w, _ in shapes), max(k for _, k in shapes)
    assert out.shape == (len(rows), width, depth) and out.dtype == dtype
    for i, row in enumerate(rows):
        w, k = row.shape
        assert torch.equal(out[i, :w, :k], row)
        assert int((out[i] != 0).sum()) == int((row != 0).sum())  # the rest is padding
    if len({tuple(r.shape) for r in rows}) == 1:
        assert torch.equal(out, torch.stack(rows))


def test_rows_that_cannot_stack_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="field 'x': no rows"):
        stack_rows("x", [])
    with pytest.raises(ValueError, match="field 'x': rows hold dtypes"):
        stack_rows("x", [torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match="field 'x'.*dimensions"):
        stack_rows("x", [torch.zeros(2), torch.zeros(2, 1)])


@given(st.lists(st.text("ab-01", max_size=8), max_size=12))
def test_the_common_prefix_starts_every_key_and_is_the_longest(keys):
    prefix = common_prefix(keys)
    assert all(k.startswith(prefix) for k in keys)
    if keys and all(len(k) > len(prefix) for k in keys):
        assert len({k[len(prefix)] for k in keys}) > 1  # one more character splits them
    if not keys:
        assert prefix == ""


@given(KEYS, st.data())
def test_a_receipt_pickles_to_itself_in_fewer_bytes_than_its_attributes(keys, data):
    lengths = data.draw(st.lists(st.integers(0, 99), min_size=len(keys), max_size=len(keys)))
    fields = data.draw(st.none() | st.lists(st.sampled_from(["a", "b", "c"]), unique=True))
    extra = data.draw(st.dictionaries(st.sampled_from(["x", "y"]), st.integers(), max_size=2))
    prefixed = [f"rollout-7-{k}" for k in keys]
    meta = KVBatchMeta(
        partition_id="p",
        sample_ids=prefixed,
        task_name=data.draw(st.none() | st.just("train")),
        fields=fields,
        sequence_lengths=data.draw(st.none() | st.just(lengths)),
        extra_info=extra,
    )
    wire = pickle.dumps(meta)
    assert pickle.loads(wire) == meta
    assert len(wire) < len(pickle.dumps(meta.__getstate__()))  # by name, whole keys

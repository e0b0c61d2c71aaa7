"""BatchedDataDict: sharding (plain, dynamic, packed) as reference §5.3, reorder, validation."""

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.data import BatchedDataDict, validate_batch
from policyworker.errors import DataError
from policyworker.functional.batching import inverse_permutation
from policyworker.functional.packing import packing_efficiency
from tests.property.strategies import SEEDS, right_padded_batches

MFFD = "modified_first_fit_decreasing"


def packing_args(capacity, *, pad_multiple=1, order="packer", algorithm=MFFD):
    return {
        "max_tokens_per_microbatch": capacity,
        "input_key": "input_ids",
        "input_lengths_key": "sequence_lengths",
        "algorithm": algorithm,
        "sequence_length_pad_multiple": pad_multiple,
        "microbatch_order": order,
    }


def batch_with_lengths(lengths, width):
    lengths = torch.as_tensor(lengths)
    rows_B = torch.arange(len(lengths))
    ids = torch.arange(width)[None, :].expand(len(lengths), width) + 1000 * rows_B[:, None]
    ids = ids.masked_fill(torch.arange(width)[None, :] >= lengths[:, None], 0)
    return BatchedDataDict(
        {
            "input_ids": ids,
            "sequence_lengths": lengths,
            "problem_ids": torch.arange(len(lengths)),
            "names": [f"row{i}" for i in range(len(lengths))],
        }
    )


# -- plain sharding ------------------------------------------------------------------------------


def test_shard_basics_follow_the_reference():
    batch = BatchedDataDict(
        {
            "tensor_data": torch.arange(8),
            "other": torch.arange(10, 18),
            "list_data": list("ABCDEFGH"),
        }
    )
    first, second = batch.shard_by_batch_size(shards=2, batch_size=4)
    assert first["tensor_data"].tolist() == [0, 1, 4, 5]
    assert second["tensor_data"].tolist() == [2, 3, 6, 7]
    assert first["other"].tolist() == [10, 11, 14, 15]
    assert first["list_data"] == ["A", "B", "E", "F"]
    assert second["list_data"] == ["C", "D", "G", "H"]
    thirds = BatchedDataDict({"x": torch.arange(12)}).shard_by_batch_size(shards=3, batch_size=3)
    assert [s["x"].tolist() for s in thirds] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def test_uneven_shards_keep_every_key_even_when_empty():
    batch = BatchedDataDict({"x": torch.tensor([[1, 2], [3, 4]]), "labels": [0, 1]})
    shards = batch.shard_by_batch_size(shards=4, allow_uneven_shards=True)
    assert [s.size for s in shards] == [1, 1, 0, 0]
    assert shards[3]["x"].shape == (0, 2) and shards[3]["labels"] == []


def test_shard_errors_use_the_reference_phrases():
    with pytest.raises(
        ValueError, match=r"Total batch size \(10\) is not a multiple of batch_size \(3\)"
    ):
        BatchedDataDict({"d": torch.arange(10)}).shard_by_batch_size(shards=2, batch_size=3)
    with pytest.raises(ValueError, match=r"Batch size \(4\) is not a multiple of shards \(3\)"):
        BatchedDataDict({"d": torch.arange(8)}).shard_by_batch_size(shards=3, batch_size=4)
    with pytest.raises(
        DataError, match="Batch sizes are not the same across the rollout batch.*'b': 3"
    ):
        BatchedDataDict({"a": torch.arange(4), "b": torch.arange(3)}).shard_by_batch_size(shards=2)
    batch = batch_with_lengths([5, 6, 7, 8], 10)
    with pytest.raises(ValueError, match="cannot be passed together"):
        batch.shard_by_batch_size(2, dynamic_batching_args={}, sequence_packing_args={})
    with pytest.raises(ValueError, match="microbatch_order"):
        batch.shard_by_batch_size(
            2, sequence_packing_args=packing_args(100, order="smallest_first")
        )
    with pytest.raises(
        ValueError,
        match=r"row 3 has 'sequence_lengths' 8 \(padded to 8.*"
        r"> max_tokens_per_microbatch 7",
    ):
        batch.shard_by_batch_size(2, sequence_packing_args=packing_args(7))


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), SEEDS)
def test_shards_concatenated_cover_every_row_once_per_global_batch(shards, per_shard, num_gb, seed):
    batch_size = shards * per_shard
    batch = BatchedDataDict(
        {"rows": torch.randperm(batch_size * num_gb, generator=torch.Generator().manual_seed(seed))}
    )
    parts = batch.shard_by_batch_size(shards=shards, batch_size=batch_size)
    assert sorted(torch.cat([p["rows"] for p in parts]).tolist()) == sorted(batch["rows"].tolist())
    for gb in range(num_gb):  # global batch gb of every shard comes from chunk gb
        chunk = set(batch["rows"][gb * batch_size : (gb + 1) * batch_size].tolist())
        got = [r for p in parts for r in p.get_batch(gb, per_shard)["rows"].tolist()]
        assert sorted(got) == sorted(chunk)


# -- reorder / from_batches / select ---------------------------------------------------------------


@given(st.permutations(list(range(9))), SEEDS)
def test_select_then_reorder_is_identity(perm, seed):
    lengths = torch.randint(0, 6, (9,), generator=torch.Generator().manual_seed(seed))
    batch = batch_with_lengths(lengths, 6)
    shuffled = batch.select_indices(perm)
    assert torch.equal(shuffled["problem_ids"], torch.tensor(perm))
    restored = shuffled.reorder_data(perm)
    assert restored is shuffled  # in place, as NeMo-RL
    assert all(torch.equal(restored[k], batch[k]) for k in ("input_ids", "sequence_lengths"))
    assert restored["names"] == batch["names"]
    permuted = batch.copy().reorder_data(inverse_permutation(perm))
    assert torch.equal(permuted["problem_ids"], torch.tensor(perm))


def test_reorder_data_is_in_place_like_nemo_rl_and_checks_first():
    b = BatchedDataDict(x=torch.tensor([10, 20, 30]), names=["a", "b", "c"])
    b.reorder_data([2, 0, 1])
    assert b["x"].tolist() == [20, 30, 10] and b["names"] == ["b", "c", "a"]
    for bad in ([0, 0, 1], [0, 1], [0, 1, 3]):
        with pytest.raises(ValueError, match=r"needs a permutation of range\(3\)"):
            b.reorder_data(bad)
    assert b["x"].tolist() == [20, 30, 10]  # unchanged by the refused calls


def test_from_batches_follows_nemo_rl_on_empty_input():
    assert BatchedDataDict.from_batches([]) == {}
    a = {"ids": torch.ones(2, 3), "names": ["p", "q"]}
    out = BatchedDataDict.from_batches([{}, a, {"ids": torch.zeros(0, 5)}])
    assert out["ids"].shape == (2, 5) and out["names"] == ["p", "q"]
    with pytest.raises(
        DataError, match=r"key 'names' is missing from non-empty batches \[1\] \(rows"
    ):
        BatchedDataDict.from_batches([a, {"ids": torch.zeros(1, 3)}])


def test_from_batches_pads_sequence_dims_and_keeps_trailing_dims():
    a = BatchedDataDict(
        {
            "logits": torch.ones(2, 3, 2),
            "ids": torch.ones(2, 3, dtype=torch.long),
            "experts": torch.ones(2, 3, 2, 1, dtype=torch.int32),
            "n": torch.tensor([1, 2]),
            "tags": ["a", "b"],
        }
    )
    b = BatchedDataDict(
        {
            "logits": 2 * torch.ones(1, 5, 2),
            "ids": 2 * torch.ones(1, 5, dtype=torch.long),
            "experts": 2 * torch.ones(1, 5, 2, 1, dtype=torch.int32),
            "n": torch.tensor([3]),
            "tags": ["c"],
        }
    )
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"logits": -5.0, "experts": -1})
    assert out["logits"].shape == (3, 5, 2) and (out["logits"][:2, 3:] == -5.0).all()
    assert out["experts"].shape == (3, 5, 2, 1) and (out["experts"][:2, 3:] == -1).all()
    assert out["ids"].tolist()[0] == [1, 1, 1, 0, 0] and out["n"].tolist() == [1, 2, 3]
    assert out["tags"] == ["a", "b", "c"] and torch.equal(out["logits"][2], b["logits"][0])


# -- dynamic batching ----------------------------------------------------------------------------


def test_dynamic_sharding_widths_are_rounded_and_within_budget():
    lengths = torch.tensor((2, 8, 4, 16, 28, 32, 2, 32), dtype=torch.int)
    batch = BatchedDataDict({"data": torch.ones(8, 128), "sequence_lengths": lengths})
    args = {
        "input_key": "data",
        "input_lengths_key": "sequence_lengths",
        "sequence_length_round": 4,
        "max_tokens_per_microbatch": 32,
    }
    shards, order = batch.shard_by_batch_size(shards=2, dynamic_batching_args=args)
    assert sorted(order) == list(range(8))
    for shard in shards:
        assert shard.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]]
        widths = [mb["data"].shape for mb in shard.make_microbatch_iterator_with_dynamic_shapes()]
        assert all(s % 4 == 0 and s <= 32 and b * s <= 32 for b, s in widths)
    restored = BatchedDataDict.from_batches(shards).reorder_data(order)
    assert torch.equal(restored["sequence_lengths"], batch["sequence_lengths"])


@settings(max_examples=40)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.sampled_from([1, 4]), SEEDS)
def test_dynamic_shards_share_boundaries_and_restore_input(
    shards, per_shard, num_gb, rounding, seed
):
    batch_size = shards * per_shard
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 17, (batch_size * num_gb,), generator=generator)
    batch = batch_with_lengths(lengths, 16)
    args = {
        "input_key": "input_ids",
        "input_lengths_key": "sequence_lengths",
        "sequence_length_round": rounding,
        "max_tokens_per_microbatch": 40,
    }
    parts, order = batch.shard_by_batch_size(shards, batch_size, dynamic_batching_args=args)
    assert all(p.micro_batch_indices == parts[0].micro_batch_indices for p in parts)
    for gb in range(num_gb):
        for part in parts:
            gb_batch = part.get_batch(gb, per_shard)
            for mb in gb_batch.make_microbatch_iterator_with_dynamic_shapes():
                width = mb["input_ids"].shape[1]
                assert mb.size * width <= 40 and bool((mb["sequence_lengths"] <= width).all())
    restored = BatchedDataDict.from_batches(parts).reorder_data(order)
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    assert restored["names"] == batch["names"]


# -- sequence packing ----------------------------------------------------------------------------


def test_largest_first_executes_each_shards_bins_by_decreasing_load():
    batch = batch_with_lengths([46, 24, 55, 88, 11, 14, 73, 17], 100)
    packer, _ = batch.shard_by_batch_size(2, sequence_packing_args=packing_args(100))
    largest, order = batch.shard_by_batch_size(
        2, sequence_packing_args=packing_args(100, order="largest_first")
    )
    assert [s.micro_batch_lengths[0] for s in largest] == [[99, 96], [87, 46]]
    for p, q in zip(packer, largest, strict=True):
        assert set(p["problem_ids"].tolist()) == set(q["problem_ids"].tolist())
        assert sorted(p.micro_batch_lengths[0], reverse=True) == q.micro_batch_lengths[0]
    restored = BatchedDataDict.from_batches(largest).reorder_data(order)
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    assert restored["names"] == batch["names"]


def test_uniform_lengths_pack_four_per_bin():
    batch = batch_with_lengths([256] * 16, 256)
    shards, _ = batch.shard_by_batch_size(2, sequence_packing_args=packing_args(1024))
    counts = [len(list(s.make_microbatch_iterator_for_packable_sequences())) for s in shards]
    assert counts == [2, 2]
    assert all(n == [1024, 1024] for s in shards for n in s.micro_batch_lengths)


@pytest.mark.parametrize("pad_multiple", [1, 32, 64, 256])
def test_packing_1024_random_sequences_into_4_global_batches_and_4_shards(pad_multiple):
    """Reference §19.8: rows stay in their global batch, counts match, efficiency bands hold."""
    bands = {1: (0.955, 1.0), 32: (0.91, 0.97), 64: (0.85, 0.92), 256: (0.60, 0.80)}
    lengths = torch.randint(50, 800, (1024,), generator=torch.Generator().manual_seed(123))
    batch = batch_with_lengths(lengths, 1024)
    args = packing_args(1200, pad_multiple=pad_multiple)
    shards, order = batch.shard_by_batch_size(4, 256, sequence_packing_args=args)
    assert len(order) == 1024
    seen: set[int] = set()
    for gb in range(4):
        legal = set(range(gb * 256, (gb + 1) * 256))
        counts, bins = [], []
        for shard in shards:
            mbs = list(shard.get_batch(gb).make_microbatch_iterator_for_packable_sequences())
            counts.append(len(mbs))
            for mb in mbs:
                ids = mb["problem_ids"].tolist()
                assert set(ids) <= legal and not seen & set(ids)
                seen |= set(ids)
                padded = -(-mb["sequence_lengths"] // pad_multiple) * pad_multiple
                assert int(padded.sum()) <= 1200
                bins.append(ids)
        assert max(counts) - min(counts) <= 1
        efficiency = packing_efficiency(bins, lengths, 1200)
        low, high = bands[pad_multiple]
        assert low <= efficiency <= high, f"gb {gb}: efficiency {efficiency:.4f}"
    assert seen == set(range(1024))
    reconstructed = BatchedDataDict.from_batches(shards)
    assert not torch.equal(reconstructed["problem_ids"], batch["problem_ids"])
    restored = reconstructed.reorder_data(order)
    assert all(
        torch.equal(restored[k], batch[k]) for k in ("input_ids", "sequence_lengths", "problem_ids")
    )


@settings(max_examples=40)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(1, 3),
    SEEDS,
    st.sampled_from(["first_fit_decreasing", MFFD, "first_fit_shuffle", "concatenative"]),
)
def test_packed_shards_cover_rows_once_and_fit_capacity(shards, per_shard, num_gb, seed, algorithm):
    batch_size = shards * per_shard
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 33, (batch_size * num_gb,), generator=generator)
    batch = batch_with_lengths(lengths, 32)
    args = packing_args(48, algorithm=algorithm)
    parts, order = batch.shard_by_batch_size(shards, batch_size, sequence_packing_args=args)
    assert sorted(order) == list(range(len(lengths)))
    for gb in range(num_gb):
        counts = {len(p.get_batch(gb).micro_batch_indices[0]) for p in parts}
        assert len(counts) == 1  # the bin count is a multiple of the shard count
        for p in parts:
            for mb, load in zip(
                p.get_batch(gb).make_microbatch_iterator_for_packable_sequences(),
                p.get_batch(gb).micro_batch_lengths[0],
                strict=True,
            ):
                assert int(mb["sequence_lengths"].sum()) == load <= 48
    restored = BatchedDataDict.from_batches(parts).reorder_data(order)
    assert torch.equal(restored["input_ids"], batch["input_ids"])


# -- misc methods --------------------------------------------------------------------------------


def test_container_methods():
    batch = batch_with_lengths([1, 2, 3, 4], 4)
    assert batch.size == 4 and BatchedDataDict().size == 0
    microbatches = [mb["problem_ids"].tolist() for mb in batch.make_microbatch_iterator(2)]
    assert microbatches == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"\(4\) is not a multiple of the microbatch size \(3\)"):
        list(batch.make_microbatch_iterator(3))
    assert batch.slice(1, 3)["names"] == ["row1", "row2"]
    rep = batch.repeat_interleave(2)
    assert rep["problem_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rep["names"][:2] == ["row0", "row0"]
    cut = batch.copy().truncate_tensors(1, 2)
    assert cut["input_ids"].shape == (4, 2) and batch["input_ids"].shape == (4, 4)
    assert type(batch.get_dict()) is dict and batch.to("cpu") is batch
    shard = batch.shard_by_batch_size(2, sequence_packing_args=packing_args(8))[0][0]
    sent = pickle.loads(pickle.dumps(shard))  # shards travel to other processes whole
    assert type(sent) is BatchedDataDict and sent.elem_counts_per_gb == shard.elem_counts_per_gb
    assert sent.micro_batch_indices == shard.micro_batch_indices


# -- validation ----------------------------------------------------------------------------------


@given(right_padded_batches(min_len=0))
def test_validate_accepts_well_formed_batches(batch):
    ids, lengths = batch
    validate_batch(
        {
            "input_ids": ids.clamp(min=0),
            "input_lengths": lengths,
            "token_mask": torch.ones_like(ids),
            "sample_mask": torch.ones(len(lengths)),
            "topk": torch.zeros(len(lengths), 3, 2),
        },
        check_dim_skip_keys=("topk",),
    )


@pytest.mark.parametrize(
    ("data", "phrase"),
    [
        (
            {"input_ids": torch.zeros(2, 4, dtype=torch.long)},
            r"missing 1 required key\(s\) \['input_lengths'\]",
        ),
        (
            {"input_ids": torch.zeros(2, 4), "input_lengths": torch.tensor([1, 2])},
            "integer token ids.*float32",
        ),
        (
            {"input_ids": torch.zeros(2, dtype=torch.long), "input_lengths": torch.tensor([1, 2])},
            r"\[B, S\].*\(2,\)",
        ),
        (
            {
                "input_ids": torch.zeros(2, 4, dtype=torch.long),
                "input_lengths": torch.tensor([[1, 2]]),
            },
            r"\[B\] tensor",
        ),
        (
            {
                "input_ids": torch.zeros(2, 4, dtype=torch.long),
                "input_lengths": torch.tensor([1, 2, 3]),
            },
            r"batch sizes disagree.*'input_lengths': \(3,\)",
        ),
        (
            {
                "input_ids": torch.zeros(2, 4, dtype=torch.long),
                "input_lengths": torch.tensor([1, 2]),
                "token_mask": torch.ones(2, 5),
            },
            r"'token_mask': \(2, 5\).*\(2, 4\).*check_dim_skip_keys",
        ),
        (
            {
                "input_ids": torch.zeros(2, 4, dtype=torch.long),
                "input_lengths": torch.tensor([1, 5]),
            },
            r"'input_lengths'\[1\] = 5 is outside \[0, S=4\]",
        ),
        (
            {
                "input_ids": torch.zeros(2, 4, dtype=torch.long),
                "input_lengths": torch.tensor([-1, 2]),
            },
            r"'input_lengths'\[0\] = -1",
        ),
    ],
)
def test_validate_rejects_bad_batches_naming_key_and_shapes(data, phrase):
    with pytest.raises(DataError, match=phrase):
        validate_batch(data)

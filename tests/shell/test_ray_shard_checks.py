"""The Ray group's driver-side checks, without Ray: the split over dp ranks and the worker's
batch checks on every shard (the group test, tests/distributed/test_ray_group.py, runs them
on a real dp2 group)."""

from __future__ import annotations

import pytest
import torch

from policyworker.errors import DataError
from policyworker.functional.loss import NLLLoss
from policyworker.shell.ray.shard_checks import check_shards
from policyworker.shell.ray.sharding import split_over_dp
from tests.shell.conftest import VOCAB, make_batch


def _split(data, batch_size=None):
    return split_over_dp(data, dp_size=2, batch_size=batch_size)


def test_the_split_names_each_shards_rows_and_refuses_an_empty_shard():
    data = make_batch(8, 6, seed=1)
    shards, rows = _split(data, batch_size=4)
    assert [r.tolist() for r in rows] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for shard, shard_rows in zip(shards, rows, strict=True):
        assert torch.equal(shard["input_ids"], data["input_ids"][shard_rows])
    with pytest.raises(ValueError, match="data has 1 rows: split over 2 data-parallel ranks"):
        _split(make_batch(1, 6))


def test_a_bad_row_is_refused_by_its_dp_rank_and_the_callers_rows():
    data = make_batch(8, 6, seed=1)
    shards, rows = _split(data, batch_size=4)
    check_shards("get_logprobs", shards, rows, vocab_rows=VOCAB)  # good data: nothing raised
    check_shards("train", shards, rows, vocab_rows=VOCAB, loss_fn=NLLLoss())

    data["input_ids"][6, 3] = VOCAB  # row 6 is the third row of rank 1's shard
    shards, rows = _split(data, batch_size=4)
    with pytest.raises(
        DataError,
        match=r"^get_logprobs: the shard of data-parallel rank 1 \(rows 2, 3, 6, 7 of data, in "
        rf"this order\) is refused before any rank starts: 'input_ids'\[2, 3\] = {VOCAB} is "
        rf"outside the model's vocabulary \[0, {VOCAB}\)",
    ):
        check_shards("get_logprobs", shards, rows, vocab_rows=VOCAB)


def test_train_checks_what_train_needs():
    data = make_batch(4, 6, seed=2)
    data["input_lengths"][1] = 0  # a training row needs a token; logprobs take it
    shards, rows = _split(data)
    check_shards("get_logprobs", shards, rows, vocab_rows=VOCAB)
    with pytest.raises(DataError, match=r"rank 0 \(rows 0, 1 .*'input_lengths' is 0 at row"):
        check_shards("train", shards, rows, vocab_rows=VOCAB, loss_fn=NLLLoss())
    good = make_batch(4, 6, seed=2)
    shards, rows = _split(good)
    with pytest.raises(ValueError, match="loss"):
        check_shards("train", shards, rows, vocab_rows=VOCAB, loss_fn=NLLLoss)  # the class
    del good["token_mask"]
    shards, rows = _split(good)
    with pytest.raises(DataError, match=r"rank 0 .*missing 1 required key\(s\) \['token_mask'\]"):
        check_shards("train", shards, rows, vocab_rows=VOCAB, loss_fn=NLLLoss())

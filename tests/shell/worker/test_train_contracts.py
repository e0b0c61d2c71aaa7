"""What train() and the batch calls accept and refuse at the edge: token-id dtypes, empty
sequences, per-sequence advantages, a loss's return value, and the timing metrics."""

from __future__ import annotations

import re
import resource

import pytest
import torch

from policyworker.errors import DataError
from policyworker.functional.loss import ClippedPGLossFn, LossInputType, LossType, NLLLoss
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import VOCAB, make_batch, make_config

INTEGER_DTYPES = [
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


@pytest.fixture(scope="module")
def paths(tiny_model_paths):
    return tiny_model_paths


def _fresh(paths) -> PolicyWorker:
    return PolicyWorker(make_config(paths["llama"]), init_reference_model=False)


@pytest.fixture(scope="module")
def worker(paths):
    return _fresh(paths)


# ------------------------------------------------------------------------------ token ids


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_every_integer_dtype_of_token_ids_trains_and_scores_like_int64(paths, dtype):
    data = make_batch(4, 10, seed=51)  # ids in [0, 128): fit every integer dtype
    cast = dict(
        data, input_ids=data["input_ids"].to(dtype), input_lengths=data["input_lengths"].to(dtype)
    )
    a, b = _fresh(paths), _fresh(paths)
    assert torch.equal(a.get_logprobs(cast)["logprobs"], b.get_logprobs(data)["logprobs"])
    assert torch.equal(
        a.get_topk_logits(cast, 3)["topk_indices"], b.get_topk_logits(data, 3)["topk_indices"]
    )
    got, want = a.train(cast, NLLLoss()), b.train(data, NLLLoss())
    assert torch.equal(got["global_loss"], want["global_loss"])


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(torch.uint8, 200), (torch.int16, 1000), (torch.int32, -3), (torch.uint64, 2**64 - 1)],
    ids=str,
)
def test_an_id_outside_the_vocabulary_is_named_with_the_callers_value(worker, dtype, value):
    data = make_batch(4, 10, seed=52)
    ids = data["input_ids"].to(dtype)
    ids[2, 5] = torch.tensor(value, dtype=dtype)
    data["input_ids"] = ids
    pattern = rf"'input_ids'\[2, 5\] = {value} is outside the model's vocabulary \[0, {VOCAB}\)"
    with pytest.raises(DataError, match=pattern):
        worker.train(data, NLLLoss())
    with pytest.raises(DataError, match=pattern):
        worker.get_logprobs(data)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64], ids=str
)
def test_non_integer_token_ids_are_refused_naming_the_dtype(worker, dtype):
    data = make_batch(4, 10, seed=53)
    data["input_ids"] = data["input_ids"].to(dtype)
    with pytest.raises(
        ValueError, match=rf"must hold integer token ids, got dtype {re.escape(str(dtype))}"
    ):
        worker.train(data, NLLLoss())
    with pytest.raises(ValueError, match=re.escape(str(dtype))):
        worker.get_logprobs(data)


def test_a_batch_without_token_columns_is_refused(worker):
    data = {
        "input_ids": torch.zeros(4, 0, dtype=torch.int64),
        "input_lengths": torch.zeros(4, dtype=torch.int64),
        "token_mask": torch.zeros(4, 0),
        "sample_mask": torch.ones(4),
    }
    with pytest.raises(ValueError, match=r"'input_ids' has shape \(4, 0\): no token positions"):
        worker.train(data, NLLLoss())
    with pytest.raises(ValueError, match="no token positions"):
        worker.get_logprobs(data)


# ------------------------------------------------------------------------------ advantages


def test_per_sequence_advantages_train_like_the_broadcast_per_token_ones(paths):
    data = make_batch(4, 10, seed=54)
    per_row = torch.randn(4, generator=torch.Generator().manual_seed(5))
    broadcast = dict(data, advantages=per_row[:, None].expand(4, 10).contiguous())
    loss = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    got = _fresh(paths).train(dict(data, advantages=per_row), loss)
    want = _fresh(paths).train(broadcast, loss)
    assert torch.equal(got["global_loss"], want["global_loss"])
    assert got["grad_norm"] == want["grad_norm"]


def test_a_per_sequence_tensor_for_another_per_token_input_is_refused_early(worker):
    data = make_batch(4, 10, seed=55)
    data["prev_logprobs"] = torch.zeros(4)
    with pytest.raises(
        DataError, match=r"'prev_logprobs' has shape \(4,\), but it holds one value per token"
    ):
        worker.train(data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}))


# ------------------------------------------------------------------------------ loss returns


class _Returns:
    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    def __init__(self, make):
        self.make = make

    def __call__(self, data, global_valid_seqs, global_valid_toks, next_token_logprobs):
        return self.make(next_token_logprobs, data)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda lp, d: lp.sum(),
            r"returned a tensor of shape \(\) .*expected a tuple \(loss, metrics\)",
        ),
        (
            lambda lp, d: (lp, {"num_valid_samples": 1.0}),
            r"returned loss a tensor of shape \(2, 9\) and dtype torch.float32; expected a 0-d",
        ),
        (
            lambda lp, d: (lp.sum(), {"loss": 1.0}),
            r"returned metrics without a number under 'num_valid_samples' \(keys: \['loss'\]",
        ),
        (lambda lp, d: (lp.sum(), [1.0]), r"returned metrics a list of 1 item\(s\); expected"),
        (
            lambda lp, d: (lp.sum().detach(), {"num_valid_samples": 2.0}),
            "returned a loss that does not require grad",
        ),
        (
            lambda lp, d: (float(lp.sum()), {"num_valid_samples": 2.0}),
            r"returned loss float .*0-d floating",
        ),
    ],
    ids=[
        "bare-tensor",
        "per-token-loss",
        "no-num_valid_samples",
        "list-metrics",
        "detached",
        "float",
    ],
)
def test_a_loss_returning_the_wrong_thing_is_refused_saying_what_was_expected(
    worker, make, message
):
    data = make_batch(4, 10, seed=56)
    with pytest.raises(ValueError, match=rf"loss_fn _Returns {message}"):
        worker.train(data, _Returns(make))


def test_a_loss_returning_the_contract_trains(worker):
    def ok(lp, d):
        return -lp.sum() / 100, {"num_valid_samples": float(d["sample_mask"].sum())}

    assert worker.train(make_batch(4, 10, seed=57), _Returns(ok))["grad_norm"] > 0


# ------------------------------------------------------------------------------ metrics


def test_train_reports_step_time_tokens_per_second_and_peak_memory(worker):
    data = make_batch(8, 10, seed=58)
    result = worker.train(data, NLLLoss())
    assert 0 < result["step_time_s"] < 120
    tokens = int(data["input_lengths"].sum())  # two whole global batches of 4 rows
    assert result["tokens_per_s"] == pytest.approx(tokens / result["step_time_s"])
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 0 < result["peak_memory_bytes"] <= peak_rss
    assert result["peak_memory_bytes"] > 50 * 2**20  # a process with torch loaded: tens of MiB


# ------------------------------------------------------------------------------ one check


def test_train_checks_its_batch_once(worker, monkeypatch):
    import policyworker.functional.batch_checks as batch_checks
    import policyworker.functional.batch_checks.train as train_checks

    calls = {"check_train_batch": 0, "validate_batch": 0, "check_batch": 0}

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counting(batch_checks, "check_train_batch")
    counting(batch_checks, "check_batch")
    counting(train_checks, "validate_batch")
    worker.train(make_batch(8, 10, seed=59), NLLLoss())  # two global batches, four microbatches
    assert calls == {"check_train_batch": 1, "validate_batch": 1, "check_batch": 0}

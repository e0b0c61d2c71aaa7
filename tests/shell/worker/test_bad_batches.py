"""Bad batches and arguments are refused before the first optimizer step, naming the key.

Each case here reached the model (a bare IndexError), trained silently, or failed after a first
global batch had already stepped.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from policyworker.errors import DataError
from policyworker.functional.loss import ClippedPGLossFn, NLLLoss
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import VOCAB, make_batch, make_config


@pytest.fixture(scope="module")
def worker(tiny_model_paths):
    return PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)


def _weights(worker):
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def _unchanged(worker, before):
    return all(torch.equal(v, before[k]) for k, v in worker.model.state_dict().items())


def _two_global_batches():
    return make_batch(8, 10, seed=31, lengths=[10, 6, 8, 4, 10, 3, 9, 5])


@pytest.mark.parametrize(
    ("row", "col", "value"),
    [(0, 2, VOCAB), (5, 9, VOCAB + 7), (6, 9, -1)],
    ids=["vocab-in-first-batch", "padding-of-second-batch", "negative"],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_any_step(worker, row, col, value):
    data = _two_global_batches()
    data["input_ids"][row, col] = value  # rows 5 and 6 are padding at col 9 (lengths 3 and 9)
    before = _weights(worker)
    with pytest.raises(DataError, match=rf"'input_ids'\[{row}, {col}\] = {value} is outside"):
        worker.train(data, NLLLoss())
    assert _unchanged(worker, before)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        worker.get_logprobs(data)


def test_empty_rows_are_refused_for_training(worker):
    data = _two_global_batches()
    data["input_lengths"][3] = 0
    with pytest.raises(DataError, match=r"'input_lengths' is 0 at row\(s\) \[3\]"):
        worker.train(data, NLLLoss())
    data["input_lengths"][:] = 0
    with pytest.raises(DataError, match="needs at least 1 token"):
        worker.train(data, NLLLoss())


def test_complex_advantages_are_refused(worker):
    data = make_batch(4, 10, seed=32)
    data["advantages"] = data["advantages"].to(torch.complex64)
    with pytest.raises(DataError, match="'advantages' has complex dtype"):
        worker.train(data, ClippedPGLossFn({}))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gbs": 0},
        {"gbs": -4},
        {"gbs": 2.0},
        {"gbs": "2"},
        {"gbs": True},
        {"mbs": 0},
        {"mbs": -1},
        {"mbs": 1.5},
    ],
)
def test_bad_gbs_and_mbs_arguments_are_refused(worker, kwargs):
    before = _weights(worker)
    name = next(iter(kwargs))
    with pytest.raises(DataError, match=rf"train\({name}=.* must be a positive int"):
        worker.train(_two_global_batches(), NLLLoss(), **kwargs)
    assert _unchanged(worker, before)


def test_integer_advantages_and_bool_masks_are_cast_not_refused(tiny_model_paths):
    data = make_batch(4, 10, seed=33)
    data["advantages"] = torch.randint(-2, 3, (4, 10))
    cast = {**data, "advantages": data["advantages"].float()}
    as_bool = {
        **data,
        "token_mask": data["token_mask"] != 0,
        "sample_mask": data["sample_mask"] > 0,
    }
    losses = []
    for batch in (cast, data, as_bool):
        w = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
        losses.append(w.train(batch, ClippedPGLossFn({}))["global_loss"])
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    torch.testing.assert_close(losses[2], losses[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("generation_logprobs", math.nan),
        ("reference_policy_logprobs", math.inf),
        ("reference_policy_logprobs", -math.inf),
        ("prev_logprobs", math.inf),
        ("advantages", math.nan),
        ("token_mask", math.nan),
    ],
)
def test_non_finite_loss_inputs_where_the_loss_reads_them_skip_that_step(worker, key, value):
    # Some of these left the loss finite (the input was sanitised or its term was off), so the
    # step used to go ahead on garbage; now the global batch holding them takes no step.
    data = make_batch(4, 10, seed=37, lengths=[10, 6, 8, 4])
    data["token_mask"][2, 4] = 1.0
    data[key][2, 4] = value
    before = _weights(worker)
    loss = ClippedPGLossFn({"reference_policy_kl_penalty": 0.1})
    with pytest.warns(UserWarning, match=rf"'{key}'\[2, 4\] = .* is not finite"):
        result = worker.train(data, loss)
    assert result["skipped_steps"] == 1
    assert _unchanged(worker, before)
    two = _two_global_batches()
    two["token_mask"][6, 4] = 1.0
    two[key][6, 4] = value  # only the second global batch is skipped
    with pytest.warns(UserWarning, match="is not finite"):
        assert worker.train(two, loss)["skipped_steps"] == 1


def test_non_finite_values_where_the_loss_does_not_read_them_are_fine(worker):
    data = make_batch(4, 10, seed=34, lengths=[10, 6, 8, 4])
    data["generation_logprobs"][1, 8] = -math.inf  # beyond row 1's length
    data["token_mask"][2, 3] = 0.0
    data["reference_policy_logprobs"][2, 3] = math.nan  # masked token
    result = worker.train(data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.1}))
    assert result["skipped_steps"] == 0 and math.isfinite(float(result["global_loss"][0]))


def test_a_global_batch_without_valid_tokens_takes_no_step(worker):
    data = make_batch(4, 10, seed=35)
    data["token_mask"][:] = 0.0
    before = _weights(worker)
    result = worker.train(data, NLLLoss())
    assert result["skipped_steps"] == 1
    assert _unchanged(worker, before)


def test_leftover_rows_are_reported(worker, caplog):
    data = make_batch(6, 10, seed=36)
    with caplog.at_level(logging.WARNING, logger="policyworker"):
        worker.train(data, NLLLoss())
    assert "2 row(s) over all data-parallel ranks are not a whole global batch" in caplog.text


def test_a_model_name_that_does_not_exist_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=rf"model_name='{missing}'.*config\.json"):
        PolicyWorker(make_config(str(missing)), init_reference_model=False)

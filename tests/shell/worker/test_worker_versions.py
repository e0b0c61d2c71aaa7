"""PolicyWorker.train with per-token weight versions: the lag metrics, the policy version it
counts, ``max_version_lag`` through the worker, and the refusals."""

import pytest
import torch

from policyworker.errors import DataError
from policyworker.functional.loss import ClippedPGLossFn
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config


@pytest.fixture
def worker(tiny_model_paths):
    return PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)


def _versions(data, newest: int) -> torch.Tensor:
    B, S = data["input_ids"].shape
    return (torch.arange(S)[None].expand(B, S) % (newest + 1)).contiguous()


def test_train_reports_the_lag_of_the_tokens_it_trained(worker):
    data = make_batch(8, 10, seed=3)  # gbs 4 (the config) -> 2 global batches, 2 steps
    versions = torch.zeros_like(data["input_ids"])
    versions[:, 5:] = 1
    data |= {"generation_versions": versions, "policy_version": torch.full((8,), 1)}
    counted = data["token_mask"][:, 1:].bool() & (
        torch.arange(1, 10)[None] < data["input_lengths"][:, None]
    )
    lag1 = (1 - versions[:, 1:])[counted]
    result = worker.train(data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}))
    assert worker.policy_version == 2
    # the second global batch trains one step later: every lag there grows by one
    first, second = lag1[: int(counted[:4].sum())], lag1[int(counted[:4].sum()) :] + 1
    lags = torch.cat([first, second]).double()
    assert result["max_version_lag"] == float(lags.max())
    assert result["mean_version_lag"] == pytest.approx(float(lags.mean()))


def test_policy_version_defaults_to_the_optimizer_steps(worker):
    data = make_batch(4, 10, seed=4)
    data["generation_versions"] = torch.zeros_like(data["input_ids"])
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    first = worker.train(data, loss_fn)
    second = worker.train(data, loss_fn)
    assert (first["max_version_lag"], second["max_version_lag"]) == (0.0, 1.0)
    assert "max_version_lag" not in worker.train(make_batch(4, 10, seed=4), loss_fn)


def test_max_version_lag_drops_stale_tokens_through_the_worker(tiny_model_paths):
    data = make_batch(4, 10, seed=5)
    data["generation_versions"] = torch.zeros_like(data["input_ids"])
    data["generation_versions"][:, 6:] = 2
    data["policy_version"] = torch.full((4,), 2)
    stale = dict(data, token_mask=data["token_mask"].clone())
    stale["token_mask"][:, 1:6] = 0  # the tokens of version 0: lag 2 > 1
    cfg = {"reference_policy_kl_penalty": 0.0}
    sums = []
    for batch, loss_cfg in [(data, cfg | {"max_version_lag": 1}), (stale, cfg)]:
        worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
        result = worker.train(batch, ClippedPGLossFn(loss_cfg))
        # stale tokens still count in global_valid_toks; the masked batch's do not
        sums.append(
            float(result["global_loss"][0]) * result["all_mb_metrics"]["global_valid_toks"][0]
        )
    assert sums[0] != 0.0
    assert sums[0] == pytest.approx(sums[1], rel=1e-5)


def test_a_token_newer_than_the_policy_is_refused(worker):
    data = make_batch(4, 10, seed=6)
    data["generation_versions"] = torch.full_like(data["input_ids"], 3)
    with pytest.raises(DataError, match="newer than"):
        worker.train(data, ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}))
    assert worker.policy_version == 0

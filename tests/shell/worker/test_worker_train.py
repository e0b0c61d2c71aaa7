"""PolicyWorker.train: global normalization, strategy invariance, skip-on-non-finite, validation."""

import math
import sys

import pytest
import torch

from policyworker.functional.loss import ClippedPGLossFn, LossInputType, LossType, NLLLoss
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config

STRATEGIES = {
    "mbs1": {"train_micro_batch_size": 1},
    "mbs2": {"train_micro_batch_size": 2},
    "dynamic": {"dynamic_batching": {"train_mb_tokens": 24, "sequence_length_round": 4}},
    "packed": {"sequence_packing": {"train_mb_tokens": 24}},
}


def _state(worker):
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _strategy_losses(path, loss_fn):
    # 8 rows, gbs 4 -> 2 global batches (2 optimizer steps); token_mask differs per row
    data = make_batch(8, 12, seed=11, lengths=[12, 5, 9, 3, 12, 7, 2, 10])
    out = {}
    for name, extra in STRATEGIES.items():
        cfg = make_config(
            path,
            **{**{"optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}}}, **extra},
        )
        worker = PolicyWorker(cfg, init_reference_model=False)
        out[name] = worker.train(data, loss_fn)["global_loss"]
    return out


@pytest.mark.parametrize(
    "loss_fn",
    [NLLLoss(), ClippedPGLossFn({"reference_policy_kl_penalty": 0.1})],
    ids=["nll", "clipped_pg_kl"],
)
def test_global_batch_loss_is_independent_of_microbatching_strategy(tiny_model_paths, loss_fn):
    losses = _strategy_losses(tiny_model_paths["llama"], loss_fn)
    assert losses["mbs1"].shape == (2,) and losses["mbs1"].dtype == torch.float32
    for name, value in losses.items():
        torch.testing.assert_close(value, losses["mbs1"], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_loss_falls_over_a_few_steps(tiny_model_paths, kind):
    worker = PolicyWorker(make_config(tiny_model_paths[kind]), init_reference_model=False)
    data = make_batch(4, 10, seed=12)
    losses = [float(worker.train(data, NLLLoss())["global_loss"][0]) for _ in range(4)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] * 0.8


def test_result_dict_and_scheduler_step_once_per_call(tiny_model_paths):
    cfg = make_config(
        tiny_model_paths["llama"],
        scheduler={
            "name": "torch.optim.lr_scheduler.StepLR",
            "kwargs": {"step_size": 1, "gamma": 0.5},
        },
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    data = make_batch(8, 10, seed=13)
    result = worker.train(data, NLLLoss())
    assert set(result) == {
        "global_loss",
        "grad_norm",
        "all_mb_metrics",
        "metric_reductions",
        "rank",
        "model_dtype",
        "skipped_steps",
        "step_time_s",
        "tokens_per_s",
        "peak_memory_bytes",
    }
    assert result["metric_reductions"] == {
        "loss": "sum",
        "num_unmasked_tokens": "sum",
        "num_valid_samples": "sum",
    }
    assert result["rank"] == 0 and result["model_dtype"] == torch.float32
    assert result["skipped_steps"] == 0 and result["grad_norm"] > 0
    metrics = result["all_mb_metrics"]
    assert len(metrics["loss"]) == 4 and metrics["lr"] == [0.01] * 4
    assert metrics["global_valid_seqs"] == [4.0] * 4
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(0.005)  # one step per call
    assert all(p.grad is None for p in worker.model.parameters())


def test_eval_mode_changes_nothing(tiny_model_paths):
    worker = PolicyWorker(make_config(tiny_model_paths["qwen2"]), init_reference_model=False)
    data = make_batch(4, 10, seed=14)
    before = _state(worker)
    lr_before = worker.scheduler.last_epoch
    result = worker.train(data, NLLLoss(), eval_mode=True)
    assert result["grad_norm"] is None and math.isfinite(float(result["global_loss"][0]))
    assert _same_state(before, _state(worker))
    assert worker.optimizer.state == {} and worker.scheduler.last_epoch == lr_before
    trained = worker.train(data, NLLLoss())  # the same loss value as the evaluated one
    torch.testing.assert_close(trained["global_loss"], result["global_loss"])


class _NaNFromData:
    """A token-level loss that is NaN when data['poison'] holds a NaN (finite otherwise)."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    def __call__(self, data, global_valid_seqs, global_valid_toks, next_token_logprobs):
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss = -(next_token_logprobs * mask).sum() / global_valid_toks + data["poison"].sum()
        return loss, {
            "loss": float(loss.detach()),
            "num_valid_samples": float(data["sample_mask"].sum()),
        }


@pytest.mark.parametrize("poison", ["loss", "advantages"])
def test_non_finite_step_is_skipped_and_leaves_weights_and_optimizer_state_bit_identical(
    tiny_model_paths, poison
):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    data = make_batch(4, 10, seed=15)
    data["poison"] = torch.zeros(4)
    loss_fn = _NaNFromData() if poison == "loss" else ClippedPGLossFn({})
    worker.train(data, loss_fn)  # creates optimizer state
    weights = _state(worker)
    opt_state = {
        id(p): {k: v.clone() for k, v in s.items()} for p, s in worker.optimizer.state.items()
    }
    epoch = worker.scheduler.last_epoch
    if poison == "loss":
        data["poison"] = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    else:
        data["advantages"] = data["advantages"].clone()
        data["advantages"][1, 3] = float("nan")
        data["token_mask"][1, 3] = 1
    with pytest.warns(UserWarning, match="optimizer step was skipped"):
        result = worker.train(data, loss_fn)
    assert result["skipped_steps"] == 1
    assert sum(result["all_mb_metrics"]["skipped_step"]) == 1.0
    assert _same_state(weights, _state(worker))
    for p, s in worker.optimizer.state.items():
        assert all(torch.equal(v, opt_state[id(p)][k]) for k, v in s.items())
    assert worker.scheduler.last_epoch == epoch
    data["poison"] = torch.zeros(4)
    data["advantages"] = torch.nan_to_num(data["advantages"])
    assert worker.train(data, loss_fn)["skipped_steps"] == 0


def _bad(kind):
    data = make_batch(4, 8, seed=16)
    if kind == "missing_lengths":
        del data["input_lengths"]
    elif kind == "batch_sizes":
        data["advantages"] = data["advantages"][:3]
    elif kind == "too_long":
        data["input_lengths"] = data["input_lengths"].clone()
        data["input_lengths"][2] = 9
    elif kind == "float_ids":
        data["input_ids"] = data["input_ids"].float()
    elif kind == "ndim":
        data["input_ids"] = data["input_ids"][..., None]
    elif kind == "missing_token_mask":
        del data["token_mask"]
    return data


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("missing_lengths", "input_lengths"),
        ("batch_sizes", "batch sizes disagree"),
        ("too_long", "input_lengths"),
        ("float_ids", "input_ids"),
        ("ndim", "input_ids"),
        ("missing_token_mask", "token_mask"),
    ],
)
def test_bad_input_raises_value_error_naming_the_key_and_changes_nothing(
    tiny_model_paths, kind, match
):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    before = _state(worker)
    with pytest.raises(ValueError, match=match):
        worker.train(_bad(kind), NLLLoss())
    if kind != "missing_token_mask":
        with pytest.raises(ValueError, match=match):
            worker.get_logprobs(_bad(kind))
    assert _same_state(before, _state(worker)) and worker.optimizer.state == {}


def test_too_few_rows_for_a_global_batch_is_a_value_error(tiny_model_paths):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    with pytest.raises(ValueError, match="gbs=4"):
        worker.train(make_batch(3, 8), NLLLoss())


class _OneMoreMicrobatchElsewhere(ParallelContext):
    """A single process that behaves as if another rank had one more microbatch (dummy path)."""

    def all_reduce_int(self, value, *, op="sum", axis="world"):
        planning = sys._getframe(1).f_code.co_name == "_plans"  # the microbatch-count MAX
        return value + 1 if planning and op == "max" else value


@pytest.mark.parametrize("mode", ["mbs2", "packed"])
def test_dummy_microbatches_change_neither_loss_nor_update_nor_outputs(tiny_model_paths, mode):
    from policyworker.config import load_config

    cfg = load_config(make_config(tiny_model_paths["llama"], **STRATEGIES[mode]))
    data = make_batch(4, 10, seed=17)
    plain = PolicyWorker(cfg, init_reference_model=False)
    padded = PolicyWorker(
        cfg,
        init_reference_model=False,
        parallel=_OneMoreMicrobatchElsewhere(
            world_size=1, rank=0, dp_size=1, cp_size=1, tp_size=1, device=torch.device("cpu")
        ),
    )
    a, b = plain.train(data, NLLLoss()), padded.train(data, NLLLoss())
    assert torch.equal(a["global_loss"], b["global_loss"])
    assert len(a["all_mb_metrics"]["loss"]) == len(b["all_mb_metrics"]["loss"])
    assert _same_state(_state(plain), _state(padded))
    assert torch.equal(plain.get_logprobs(data)["logprobs"], padded.get_logprobs(data)["logprobs"])


@pytest.mark.parametrize("release", [False, True])
def test_train_returns_the_cuda_cache_only_when_configured(tiny_model_paths, monkeypatch, release):
    cfg = make_config(tiny_model_paths["llama"], dtensor_cfg={"release_cache_after_train": release})
    worker = PolicyWorker(cfg, init_reference_model=False)
    calls = []
    monkeypatch.setattr(type(worker.state), "empty_cache", lambda _: calls.append("empty_cache"))
    worker.train(make_batch(4, 10, seed=14), NLLLoss())
    assert calls == (["empty_cache"] if release else [])


class _ShareLoss(NLLLoss):
    """NLL with one more metric, a share of the global batch whose name reads like an extreme."""

    def __call__(self, data, global_valid_seqs, global_valid_toks, **inputs):
        loss, metrics = super().__call__(data, global_valid_seqs, global_valid_toks, **inputs)
        return loss, {**metrics, "share_max": float(metrics["num_valid_samples"]) / 8}


class _AdvertisedShareLoss(_ShareLoss):
    metric_normalizations = {**NLLLoss.metric_normalizations, "share_max": "sequences"}


@pytest.mark.parametrize(
    ("loss_fn", "share"), [(_ShareLoss(), 0.25), (_AdvertisedShareLoss(), 1.0)]
)
def test_train_reduces_metrics_by_the_losses_advertised_normalizers(
    tiny_model_paths, loss_fn, share
):
    from policyworker.functional.metrics import flatten_train_metrics

    cfg = make_config(tiny_model_paths["llama"], train_global_batch_size=8)
    worker = PolicyWorker(cfg, init_reference_model=False)
    result = worker.train(make_batch(8, 10, seed=3), loss_fn)
    assert len(result["all_mb_metrics"]["share_max"]) == 4  # 4 microbatches of 2 rows
    advertised = "share_max" in getattr(loss_fn, "metric_normalizations", {})
    assert ("share_max" in result["metric_reductions"]) == advertised
    # by name a `_max` metric is the largest microbatch value; advertised, the global share sums
    assert flatten_train_metrics(result)["share_max"] == pytest.approx(share)

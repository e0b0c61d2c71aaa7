"""bench/train_step's optimizer choice: the optimizer section per class, the MFU target of the
7B shape trained in full, the rows beside another optimizer, and a worker the pre-flight memory
check refuses reported as a row (CPU)."""

import argparse
import json

import pytest

from bench import train_step
from bench.common import save_random_model
from bench.train_step_rows import optimizer_rows
from policyworker._dev.bench_table import normalize_rows


def _args(**overrides) -> argparse.Namespace:
    settings = {
        "small": True,
        "shape": "1.5b",
        "lora_dim": 0,
        "precision": "float32",
        "batch": 2,
        "padded_mbs": 1,
        "chunk": None,
        "activation_checkpointing": False,
        "fuse": "none",
        "mb_tokens": 64,
        "optimizer": "torch.optim.Adafactor",
        "optimizer_kwargs": None,
        "also_optimizer": "torch.optim.AdamW",
        "eager_logprobs": False,
        "steps": 1,
    }
    return argparse.Namespace(**{**settings, **overrides})


def test_optimizer_section_takes_the_class_settings_then_the_json_override():
    adafactor = train_step.optimizer_section("torch.optim.Adafactor", _args())
    assert adafactor == {
        "name": "torch.optim.Adafactor",
        "kwargs": {"lr": 5e-5, "weight_decay": 0.01},
    }
    adamw = train_step.optimizer_section("torch.optim.AdamW", _args(optimizer_kwargs='{"lr": 2}'))
    assert adamw["kwargs"]["lr"] == 2 and "fused" in adamw["kwargs"]
    other = train_step.optimizer_section("torch.optim.SGD", _args())
    assert other == {"name": "torch.optim.SGD", "kwargs": {"lr": 1e-6}}


@pytest.mark.parametrize(
    ("shape", "lora_dim", "target"),
    [("7b", 0, 0.35), ("7b", 16, 0.45), ("1.5b", 0, 0.50), ("1.5b", 16, None)],
)
def test_the_7b_shape_trained_in_full_has_its_own_mfu_target(shape, lora_dim, target):
    assert train_step.mfu_target(_args(shape=shape, lora_dim=lora_dim)) == target


def test_rows_beside_another_optimizer_compare_speed_memory_and_the_plan():
    ours = {"optimizer": "A", "tokens_per_s": 90.0, "mfu": 0.4, "peak_gib": 50.0, "loss": 2.0}
    other = {"optimizer": "B", "tokens_per_s": 100.0, "mfu": 0.44, "peak_gib": 100.0, "loss": 2.0}
    planned = {"planned_peak_gib": 105.0}
    rows = normalize_rows("b", {"rows": optimizer_rows(ours, {**other, **planned}), "settings": {}})
    by_metric = {r.metric: r for r in rows}
    assert by_metric["packed tok/s, A vs B"].ratio == 0.9
    assert by_metric["peak GiB, A vs B"].ratio == 0.5
    assert by_metric["planned / measured peak GiB (packed, B)"].ratio == 1.05
    refused = optimizer_rows(ours, {"optimizer": "B", "refused": "does not fit"})
    assert refused == [{"metric": "B: refused by the pre-flight check (does not fit)"}]


def test_a_worker_the_pre_flight_check_refuses_is_a_row_not_a_crash(tmp_path, monkeypatch):
    num_params = save_random_model(tmp_path / "model", small=True)
    config = train_step.worker_config

    def tiny_budget(*args, **kwargs):
        cfg = config(*args, **kwargs)
        cfg["dtensor_cfg"]["memory_budget_gb"] = 1e-5  # not even the weights fit
        return cfg

    monkeypatch.setattr(train_step, "worker_config", tiny_budget)
    result = train_step.optimizer_row(str(tmp_path / "model"), _args(), {}, num_params)
    assert result["optimizer"] == "torch.optim.AdamW"
    assert "is predicted to need" in result["refused"]
    json.dumps(result)

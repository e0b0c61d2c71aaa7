"""The memory planner on a worker: the table, the shape read from an HF config, the pre-flight
refusal naming phase, bytes and knob, and auto-tune picking sizes that fit a budget."""

from __future__ import annotations

import attrs
import pytest
import transformers

from policyworker.config import load_config
from policyworker.errors import ConfigError
from policyworker.functional.loss import NLLLoss
from policyworker.functional.memory_plan import PHASES, plan_memory, with_knob
from policyworker.shell.worker import memory_calls
from policyworker.shell.worker.policy_worker import PolicyWorker
from policyworker.testing import tiny_model
from tests.shell.conftest import make_batch, make_config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_shape_from_the_hf_config_counts_the_built_models_parameters(arch):
    model = tiny_model(arch, vocab=128)
    from_config = memory_calls.shape_from_hf_config(model.config)
    from_model = memory_calls.shape_from_model(model)
    assert from_config.num_params == from_model.num_params
    assert from_config.num_params == from_config.num_trainable
    assert from_config == from_model


def test_plan_memory_lists_every_phase_with_the_fp32_weights_of_the_live_model(
    tiny_model_paths,
):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    table = worker.plan_memory()
    assert tuple(table) == PHASES
    params = sum(p.numel() for p in worker.model.parameters())
    assert table["train_step"]["terms"]["weights"] == 4 * params
    assert table["optimizer_step"]["terms"]["optimizer_state"] == 2 * 4 * params  # AdamW
    for row in table.values():
        assert row["total_bytes"] == sum(row["terms"].values())
        assert row["budget_bytes"] is None and row["fits"] is None  # CPU, no budget set


def test_a_budget_too_small_is_refused_at_construction_naming_phase_bytes_and_knob(
    tiny_model_paths,
):
    cfg = make_config(
        tiny_model_paths["llama"],
        max_total_sequence_length=64,
        dtensor_cfg={"memory_budget_gb": 1e-5},  # 10 KiB: not even the weights fit
    )
    with pytest.raises(ConfigError) as err:
        PolicyWorker(cfg, init_reference_model=False)
    text = str(err.value)
    assert "the train_step phase is predicted to need" in text
    assert "bytes" in text and "are available" in text
    assert "train_mb_tokens" in text and "auto_tune" in text


def test_the_cpu_is_not_checked_without_a_budget(tiny_model_paths):
    cfg = load_config(make_config(tiny_model_paths["llama"], max_total_sequence_length=10**6))
    assert memory_calls.preflight(cfg) is cfg


def test_auto_tune_on_the_cpu_without_a_budget_names_the_key(tiny_model_paths):
    cfg = make_config(tiny_model_paths["llama"], dtensor_cfg={"auto_tune": True})
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        PolicyWorker(cfg, init_reference_model=False)


def test_auto_tune_picks_the_largest_packing_tokens_that_fit_and_the_worker_trains(
    tiny_model_paths,
):
    budget_gb = 0.01
    cfg = make_config(
        tiny_model_paths["llama"],
        max_total_sequence_length=16,
        sequence_packing={"enabled": True, "train_mb_tokens": 16},
        dtensor_cfg={"memory_budget_gb": budget_gb, "auto_tune": True},
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    tuned = worker.cfg.sequence_packing
    assert tuned.train_mb_tokens > 16 and tuned.train_mb_tokens % 256 == 0
    budget = int(budget_gb * 2**30)
    table = worker.plan_memory()
    assert all(row["fits"] for row in table.values()), table
    # One step more would not fit (the bisection's answer is the largest).
    shape = memory_calls.shape_from_model(worker.model)
    knobs = memory_calls.knobs_from_config(
        worker.cfg, device=worker.state.device, fused_logprobs=False
    )
    knobs = attrs.evolve(knobs, grads_in_forward=True)  # the tuner's conservative count
    bigger = with_knob(knobs, "train_mb_tokens", tuned.train_mb_tokens + 256)
    assert plan_memory(shape, bigger).phase("train_step").total > budget
    worker.train(make_batch(4, 12), NLLLoss())


def test_the_hf_config_shape_with_lora_counts_only_the_adapters():
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    shape = memory_calls.shape_from_hf_config(config, lora_rank=8)
    assert 0 < shape.num_trainable < shape.num_params

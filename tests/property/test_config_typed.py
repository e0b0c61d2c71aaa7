"""`PolicyConfig(...)` refuses what `load_config(mapping)` refuses, with the same `ConfigError`:
types, literal choices, nested sections (as classes or mappings), field and cross-field rules."""

from typing import Any

import attrs
import pytest
from hypothesis import given, settings

from policyworker.config import (
    DTensorConfig,
    LoRAConfig,
    PolicyConfig,
    config_to_dict,
    converter,
    load_config,
)
from policyworker.errors import ConfigError
from tests.property.test_config import policy_configs


def message_of(build: Any) -> str:
    with pytest.raises(ConfigError) as info:
        build()
    return str(info.value)


BAD = [
    ({"train_micro_batch_size": 0}, "train_micro_batch_size = 0 must be >= 1"),
    ({"train_global_batch_size": "32"}, "expected an integer, got '32' (str)"),
    ({"precision": "fp64"}, "'fp64' is not a precision"),
    ({"max_grad_norm": -1.0}, "max_grad_norm = -1.0 must be > 0"),
    ({"hf_config_overrides": [1, 2]}, "expected a mapping, got [1, 2] (list)"),
    ({"generation": {"top_p": 1.5}}, "top_p = 1.5 must be in (0, 1]"),
    ({"dtensor_cfg": {"attn_implementation": "flash"}}, "'flash' is not one of"),
    ({"dtensor_cfg": {"lora_cfg": {"target_modules": "all-linear"}}}, "PEFT's spelling"),
    (
        {"train_global_batch_size": 6, "train_micro_batch_size": 4},
        "must be a multiple of train_micro_batch_size = 4",
    ),
    (
        {"sequence_packing": {"train_mb_tokens": 64}, "dynamic_batching": {"train_mb_tokens": 64}},
        "are both enabled but are exclusive",
    ),
]


@pytest.mark.parametrize(("bad", "phrase"), BAD)
def test_typed_and_mapping_paths_raise_the_same_error(bad, phrase):
    from_mapping = message_of(lambda: load_config({"model_name": "m", **bad}))
    typed = message_of(lambda: PolicyConfig(model_name="m", **bad))
    assert typed == from_mapping
    assert phrase in typed


def test_sections_built_as_classes_are_checked_like_their_mappings():
    lora = LoRAConfig(dropout_position="middle")  # type: ignore[arg-type]
    dtensor = DTensorConfig(attn_implementation="flash", lora_cfg=lora)  # type: ignore[arg-type]
    typed = message_of(lambda: PolicyConfig(model_name="m", dtensor_cfg=dtensor))
    mapping = {
        "model_name": "m",
        "dtensor_cfg": {"attn_implementation": "flash", "lora_cfg": {"dropout_position": "middle"}},
    }
    assert typed == message_of(lambda: load_config(mapping))
    assert "(2 problems)" in typed
    assert "@ policy.dtensor_cfg.lora_cfg.dropout_position" in typed


def test_every_problem_is_listed_at_once_on_the_typed_path():
    typed = message_of(lambda: PolicyConfig(model_name="", precision="x", batch_size=0))
    assert typed.splitlines()[0] == "invalid policy config (3 problems):"
    for path in ("model_name", "precision", "batch_size"):
        assert f"@ policy.{path}" in typed


@settings(max_examples=30)
@given(cfg=policy_configs())
def test_typed_construction_accepts_every_valid_config_and_evolve_keeps_it(cfg):
    assert load_config(config_to_dict(cfg)) == cfg
    assert attrs.evolve(cfg) == cfg
    assert PolicyConfig(**{a.name: getattr(cfg, a.name) for a in attrs.fields(PolicyConfig)}) == cfg
    assert converter.structure(converter.unstructure(cfg), PolicyConfig) == cfg

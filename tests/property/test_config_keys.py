"""Unknown keys: `strict=False` drops them with one warning naming each (with its did-you-mean),
`strict=True` (the default) refuses them; PEFT's LoRA spellings get a hint naming our key."""

import copy
import warnings
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.config import ConfigWarning, config_to_dict, load_config
from policyworker.config.files import load_config_file
from policyworker.errors import ConfigError
from tests.property.test_config import FREE_DICTS, dotted, node_at, policy_configs

Path = tuple[str | int, ...]


def mapping_nodes(tree: Any, path: Path = ()) -> list[Path]:
    """Paths of every mapping the schema owns (not free dicts such as `kwargs`)."""
    found: list[Path] = []
    if isinstance(tree, dict):
        found.append(path)
        for key, value in tree.items():
            if key not in FREE_DICTS:
                found += mapping_nodes(value, (*path, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            found += mapping_nodes(value, (*path, index))
    return found


def load_leniently(mapping: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(mapping, strict=False)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


@settings(max_examples=40)
@given(cfg=policy_configs(), data=st.data())
def test_unknown_keys_anywhere_are_dropped_with_one_warning_or_refused(cfg, data):
    tree = config_to_dict(cfg)
    parents = data.draw(
        st.lists(st.sampled_from(mapping_nodes(tree)), min_size=1, max_size=3, unique=True)
    )
    for parent in parents:
        node_at(tree, parent)["zq_unread"] = {"any": [1, 2]}
    loaded, messages = load_leniently(copy.deepcopy(tree))
    assert loaded == cfg
    assert len(messages) == 1
    for parent in parents:
        assert f"{dotted(parent)}.zq_unread" in messages[0]
    with pytest.raises(ConfigError, match="extra fields found"):
        load_config(tree)


def test_lenient_loading_names_the_key_it_likely_meant_and_still_checks_values():
    mapping = {
        "model_name": "m",
        "learning_rate": 1e-5,
        "dtensor_cfg": {"tensor_paralel_size": 2, "lora_cfg": {"enabled": False, "r": 8}},
    }
    cfg, messages = load_leniently(mapping)
    assert cfg == load_config({"model_name": "m"})
    assert messages == [
        "ignoring 3 unknown policy keys (strict=False): policy.learning_rate; "
        "policy.dtensor_cfg.tensor_paralel_size (did you mean 'tensor_parallel_size'?); "
        "policy.dtensor_cfg.lora_cfg.r (PEFT's name for 'dim'; write dim instead); fix or "
        "remove them, or load with strict=True to make them errors"
    ]
    bad = {"model_name": "m", "zz": 1, "train_micro_batch_size": 0}
    with (
        pytest.warns(ConfigWarning, match=r"policy\.zz"),
        pytest.raises(ConfigError, match=r"must be >= 1 @ policy\.train_micro_batch_size"),
    ):
        load_config(bad, strict=False)


def test_a_known_config_loads_leniently_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config({"model_name": "m"}, strict=False) == load_config({"model_name": "m"})


def test_load_config_file_passes_strict_through(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("policy:\n  model_name: m\n  checkpointing: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"extra fields found \(checkpointing\) @ policy"):
        load_config_file(path)
    with pytest.warns(ConfigWarning, match=r"policy\.checkpointing"):
        assert load_config_file(path, strict=False) == load_config({"model_name": "m"})


@pytest.mark.parametrize(
    ("key", "ours"), [("r", "dim"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout")]
)
def test_peft_lora_spellings_name_our_key(key, ours):
    mapping = {"model_name": "m", "dtensor_cfg": {"lora_cfg": {key: 0.1}}}
    with pytest.raises(ConfigError) as info:
        load_config(mapping)
    assert (
        f"extra fields found ({key}: PEFT's name for {ours!r}; write {ours} instead) "
        "@ policy.dtensor_cfg.lora_cfg"
    ) in str(info.value)


@pytest.mark.parametrize("spelling", ["all-linear", "all_linear", "ALL-LINEAR"])
def test_peft_all_linear_points_to_match_all_linear(spelling):
    mapping = {"model_name": "m", "dtensor_cfg": {"lora_cfg": {"target_modules": spelling}}}
    with pytest.raises(ConfigError) as info:
        load_config(mapping)
    assert (
        f"{spelling!r} is PEFT's spelling of every linear layer; write match_all_linear: true "
        "and leave target_modules empty @ policy.dtensor_cfg.lora_cfg.target_modules"
    ) in str(info.value)
    fixed = load_config(
        {"model_name": "m", "dtensor_cfg": {"lora_cfg": {"match_all_linear": True}}}
    )
    assert fixed.dtensor_cfg.lora_cfg is not None and fixed.dtensor_cfg.lora_cfg.match_all_linear


def test_one_module_name_as_a_string_asks_for_a_list():
    mapping = {"model_name": "m", "dtensor_cfg": {"lora_cfg": {"exclude_modules": "lm_head"}}}
    with pytest.raises(ConfigError, match=r"write \[lm_head\] @ policy\.dtensor_cfg\.lora_cfg"):
        load_config(mapping)

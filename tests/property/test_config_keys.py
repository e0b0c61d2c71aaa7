"""Unknown keys: by default one close to a known key is an error with its did-you-mean and any
other is accepted, not read, with one warning naming each; `strict=True` refuses them all; PEFT's
LoRA spellings get a hint naming our key. Disabled sections keep the values they were given."""

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
        cfg = load_config(mapping)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


@settings(max_examples=40)
@given(cfg=policy_configs(), data=st.data())
def test_unknown_keys_anywhere_are_accepted_with_one_warning_or_refused_when_strict(cfg, data):
    tree = config_to_dict(cfg)
    parents = data.draw(
        st.lists(st.sampled_from(mapping_nodes(tree)), min_size=1, max_size=3, unique=True)
    )
    for parent in parents:
        node_at(tree, parent)["zq_unread"] = {"any": [1, 2]}
    loaded, messages = load_leniently(copy.deepcopy(tree))
    assert loaded == cfg
    assert len(messages) == 1
    assert messages[0].startswith("accepted, not read: ")
    for parent in parents:
        assert f"{dotted(parent)}.zq_unread" in messages[0]
    with pytest.raises(ConfigError, match="extra fields found"):
        load_config(tree, strict=True)


@settings(max_examples=40)
@given(cfg=policy_configs(), data=st.data())
def test_a_key_close_to_a_known_one_is_an_error_by_default(cfg, data):
    tree = config_to_dict(cfg)
    parent = data.draw(st.sampled_from(mapping_nodes(tree)))
    node = node_at(tree, parent)
    known = [k for k in node if k != "enabled"]
    if not known:
        return
    key = data.draw(st.sampled_from(sorted(known)))
    node[f"{key}_typo"] = node.pop(key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(ConfigError) as info:
            load_config(tree)
    assert f"extra fields found ({key}_typo: did you mean " in str(info.value)


def test_typos_are_errors_other_unknown_keys_are_accepted_and_values_still_checked():
    mapping = {
        "model_name": "m",
        "zq_note": 1,
        "dtensor_cfg": {"tensor_paralel_size": 2, "lora_cfg": {"enabled": False, "r": 8}},
    }
    with (
        pytest.warns(ConfigWarning, match=r"accepted, not read: 1 unknown policy key .*zq_note"),
        pytest.raises(ConfigError) as info,
    ):
        load_config(mapping)
    assert str(info.value).splitlines()[1:] == [
        "  extra fields found (tensor_paralel_size: did you mean 'tensor_parallel_size'?) "
        "@ policy.dtensor_cfg",
        "  extra fields found (r: PEFT's name for 'dim'; write dim instead) "
        "@ policy.dtensor_cfg.lora_cfg",
    ]
    bad = {"model_name": "m", "zz": 1, "train_micro_batch_size": 0}
    with (
        pytest.warns(ConfigWarning, match=r"policy\.zz"),
        pytest.raises(ConfigError, match=r"must be >= 1 @ policy\.train_micro_batch_size"),
    ):
        load_config(bad)


def test_nemo_rl_worker_test_config_keys_are_accepted_without_a_warning():
    mapping = {
        "model_name": "m",
        "learning_rate": 5e-6,
        "checkpointing": {"enabled": False, "checkpoint_dir": "/tmp/x"},
        "dtensor_cfg": {"lora": {"enabled": False}},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(mapping) == load_config({"model_name": "m"})
        assert load_config(mapping, strict=True) == load_config({"model_name": "m"})


# Each optional section and keys it owns with values it accepts.
_SECTION_VALUES: dict[str, dict[str, Any]] = {
    "sequence_packing": {"algorithm": st.sampled_from(["modified_first_fit_decreasing"])},
    "dynamic_batching": {"train_mb_tokens": st.integers(1, 4096)},
    "dtensor_cfg.lora_cfg": {"dim": st.integers(1, 64), "alpha": st.integers(1, 64)},
    "reward_model_cfg": {"reward_model_type": st.just("bradley_terry")},
    "router_replay": {},
    "draft": {"loss_weight": st.floats(0, 1), "num_layers": st.integers(1, 4)},
}


@settings(max_examples=40)
@given(data=st.data(), path=st.sampled_from(sorted(_SECTION_VALUES)))
def test_a_disabled_section_keeps_the_values_it_was_given(data, path):
    values = data.draw(st.fixed_dictionaries({}, optional=_SECTION_VALUES[path]))
    *parents, leaf = path.split(".")
    tree: dict[str, Any] = {"model_name": "m"}
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = {"enabled": False, **values}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(copy.deepcopy(tree))
    assert cfg == load_config({"model_name": "m"})
    assert cfg.disabled_sections == {path: values}
    back = config_to_dict(cfg)
    assert node_at(back, tuple(path.split("."))) == {"enabled": False, **values}
    assert load_config(back).disabled_sections == cfg.disabled_sections


def test_lora_disabled_reads_back_its_dim():
    cfg = load_config(
        {"model_name": "m", "dtensor_cfg": {"lora_cfg": {"enabled": False, "dim": 16}}}
    )
    assert not cfg.lora_enabled
    assert cfg.disabled_sections["dtensor_cfg.lora_cfg"]["dim"] == 16
    assert config_to_dict(cfg)["dtensor_cfg"]["lora_cfg"] == {"enabled": False, "dim": 16}


def test_a_known_config_loads_leniently_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config({"model_name": "m"}, strict=False) == load_config({"model_name": "m"})


def test_load_config_file_passes_strict_through(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("policy:\n  model_name: m\n  zq_notes: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"extra fields found \(zq_notes\) @ policy"):
        load_config_file(path, strict=True)
    with pytest.warns(ConfigWarning, match=r"policy\.zq_notes"):
        assert load_config_file(path) == load_config({"model_name": "m"})


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

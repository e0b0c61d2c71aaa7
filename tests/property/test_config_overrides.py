"""Hydra's override grammar on plain mappings: `key=v` sets, `+key=v` adds a new key, `++key=v`
sets or adds, `~key` (or `~key=v`, when the value matches) deletes; a bad override raises
`OverrideError` naming the override, the rule and the fix."""

import copy
import json
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from policyworker.config.files import (
    OverrideError,
    apply_overrides,
    load_config_file,
    read_override,
)
from policyworker.errors import ConfigError

KEYS = st.sampled_from(["a", "b", "lr", "tp_size", "x_1"])
SCALARS = st.one_of(st.integers(-5, 5), st.booleans(), st.none(), st.lists(st.integers(0, 3)))
TREES = st.dictionaries(
    KEYS, st.recursive(SCALARS, lambda inner: st.dictionaries(KEYS, inner, max_size=3)), max_size=4
)
Path = tuple[str, ...]


def paths_in(tree: dict[str, Any], prefix: Path = ()) -> list[Path]:
    found: list[Path] = []
    for key, value in tree.items():
        found.append((*prefix, key))
        if isinstance(value, dict):
            found += paths_in(value, (*prefix, key))
    return found


def value_at(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def text(prefix: str, path: Path, value: Any = None, *, with_value: bool = True) -> str:
    dotted = ".".join(path)
    return f"{prefix}{dotted}={json.dumps(value)}" if with_value else f"{prefix}{dotted}"


@given(TREES, st.data(), SCALARS)
def test_set_and_force_set_write_the_value_and_leave_the_input_alone(tree, data, value):
    path = data.draw(st.sampled_from([*paths_in(tree), ("new",), ("a", "new")]))
    before = copy.deepcopy(tree)
    try:
        forced = apply_overrides(tree, [text("++", path, value)])
    except OverrideError as exc:  # only a scalar on the way down stops a set
        assert "not a mapping" in str(exc)
        return
    assert tree == before
    assert value_at(forced, path) == value
    if path in paths_in(tree):
        assert apply_overrides(tree, [text("", path, value)]) == forced
        assert apply_overrides(tree, [text("policy.", path, value)]) == forced
    else:
        with pytest.raises(OverrideError, match=r"could not override .* write '\+"):
            apply_overrides(tree, [text("", path, value)])


@given(TREES, st.data(), SCALARS)
def test_a_plain_set_of_a_missing_key_is_refused_with_the_add_form(tree, data, value):
    paths = paths_in(tree)
    assume(paths)
    path = data.draw(st.sampled_from(paths))
    missing = (*path[:-1], path[-1] + "x")
    assume(missing not in paths)
    override = text("", missing, value)
    with pytest.raises(OverrideError) as info:
        apply_overrides(tree, [override])
    message = str(info.value)
    assert repr(override) in message
    assert f"write '+{'.'.join(missing)}=...'" in message
    assert "did you mean " in message


@given(TREES, st.data(), SCALARS)
def test_add_is_force_set_on_a_new_key_and_refuses_an_existing_one(tree, data, value):
    paths = paths_in(tree)
    assume(paths)
    existing = data.draw(st.sampled_from(paths))
    override = text("+", existing, value)
    with pytest.raises(OverrideError, match=r"already exists .* write '\+\+") as info:
        apply_overrides(tree, [override])
    assert repr(override) in str(info.value)
    parent = existing[:-1]
    new = (*parent, "zz_new")
    assert apply_overrides(tree, [text("+", new, value)]) == apply_overrides(
        tree, [text("++", new, value)]
    )


@given(TREES, st.data())
def test_delete_then_add_back_is_the_identity(tree, data):
    paths = paths_in(tree)
    assume(paths)
    path = data.draw(st.sampled_from(paths))
    old = value_at(tree, path)
    deleted = apply_overrides(tree, [text("~", path, with_value=False)])
    assert path[-1] not in value_at(deleted, path[:-1])
    assert apply_overrides(deleted, [text("+", path, old)]) == tree
    assert apply_overrides(tree, [text("~", path, old)]) == deleted
    with pytest.raises(OverrideError, match="no key .* to delete; check its spelling"):
        apply_overrides(deleted, [text("~", path, with_value=False)])


def test_delete_with_a_value_deletes_only_a_match():
    tree = {"generation": {"top_k": 50}}
    with pytest.raises(
        OverrideError,
        match=r"'generation\.top_k' holds 50, not 20, .* write '~generation\.top_k'",
    ):
        apply_overrides(tree, ["~generation.top_k=20"])
    assert apply_overrides(tree, ["~generation.top_k=50"]) == {"generation": {}}
    with pytest.raises(OverrideError, match=r"no key 'scheduler\.name' to delete"):
        apply_overrides(tree, ["~scheduler.name"])


@pytest.mark.parametrize(
    "bad", ["+++a=1", "+a", "++a", "~", "~=1", "+~a=1", "~+a", "+=1", "a", "+a..b=1", "~a."]
)
def test_malformed_forms_name_the_override_and_the_grammar(bad):
    with pytest.raises(OverrideError) as info:
        apply_overrides({"a": 1}, [bad])
    message = str(info.value)
    assert repr(bad) in message
    assert "+dotted.key=value (add a new key), ++dotted.key=value (set or add)" in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_read_override_gives_the_operation():
    assert (read_override("+a.b=2").op, read_override("+a.b=2").path) == ("add", ("a", "b"))
    assert read_override("++policy.a=[1, 2]").value == [1, 2]
    bare = read_override("~a")
    assert (bare.op, bare.has_value) == ("delete", False)
    assert read_override("a=x").op == "set"


def test_file_overrides_add_force_and_delete(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(
        "policy:\n  model_name: m\n  generation:\n    temperature: 0.7\n    top_k: 20\n"
        "  max_total_sequence_length: 64\n"
    )
    cfg = load_config_file(
        path,
        overrides=[
            "~generation.top_k",
            "++generation.top_p=0.9",
            "+dtensor_cfg.tensor_parallel_size=2",
            "++max_total_sequence_length=128",
        ],
    )
    assert cfg.generation is not None
    assert (cfg.generation.top_k, cfg.generation.top_p, cfg.generation.temperature) == (
        None,
        0.9,
        0.7,
    )
    assert (cfg.dtensor_cfg.tensor_parallel_size, cfg.max_total_sequence_length) == (2, 128)
    with pytest.raises(OverrideError, match=r"'model_name' already exists"):
        load_config_file(path, overrides=["+model_name=other"])

"""The ways in and out: `load_config(mapping)` and `config_to_dict(cfg)`, and the reading of
unknown keys (a typo is an error; any other is accepted, not read, with one warning; `strict=True`
refuses them all)."""

import logging
import warnings
from collections.abc import Mapping
from typing import Any, cast, get_args

import attrs
from attrs import frozen

from policyworker.config.converter import converter
from policyworker.config.messages import closest_key, unknown_key_hint
from policyworker.config.nemo_rl_keys import split_ignored_keys
from policyworker.config.policy import PolicyConfig, place_disabled_sections, structure_policy
from policyworker.config.rules import ConfigWarning, describe
from policyworker.config.sections import SECTIONS, SchedulerConfig, SchedulerEntry
from policyworker.errors import ConfigError

__all__ = [
    "UnknownKey",
    "config_to_dict",
    "drop_unknown_keys",
    "load_config",
    "split_unknown_keys",
]

logger = logging.getLogger("policyworker")


def load_config(mapping: Mapping[str, Any], *, strict: bool = False) -> PolicyConfig:
    """Structure a plain mapping (e.g. NeMo-RL's `policy:` block) into a PolicyConfig.

    Unknown keys (at any depth) are read as NeMo-RL reads its TypedDicts: one close to a known
    key is a typo and an error with its did-you-mean; any other is accepted, not read, and named
    once in a `ConfigWarning`. `strict=True` refuses every unknown key. Values are checked as
    strictly either way.

    Raises:
        ConfigError: listing every problem, one per line, each ending `@ policy.<path>`.
    """
    if not isinstance(mapping, Mapping):  # pyright: ignore[reportUnnecessaryIsInstance]
        msg = f"a policy config must be a mapping, got {describe(mapping)} @ policy"
        raise ConfigError(msg)
    cleaned, ignored = split_ignored_keys(mapping)
    if ignored:
        logger.info(
            "accepted, not used: these NeMo-RL policy keys are valid but this worker does not "
            "read them (docs/config-reference.md says why): %s",
            ", ".join(f"policy.{path}" for path in ignored),
        )
    if strict:
        return structure_policy(cleaned)
    cleaned, unknown = split_unknown_keys(cleaned)
    unread = [f"{key.parent}.{key.key}" for key in unknown if key.hint is None]
    if unread:
        warnings.warn(
            f"accepted, not read: {len(unread)} unknown policy key{'s' * (len(unread) != 1)} "
            f"no config class has: {'; '.join(unread)}; remove them, or load with strict=True "
            "to make them errors",
            ConfigWarning,
            stacklevel=2,
        )
    typos = [
        f"extra fields found ({key.key}: {key.hint}) @ {key.parent}"
        for key in unknown
        if key.hint is not None
    ]
    return structure_policy(cleaned, problems=typos)


def config_to_dict(cfg: PolicyConfig) -> dict[str, Any]:
    """Plain JSON-able mapping (NeMo-RL key names) with `load_config(config_to_dict(c)) == c`."""
    result: dict[str, Any] = converter.unstructure(cfg)
    return place_disabled_sections(result)


@frozen
class UnknownKey:
    """A key no config class has: the mapping holding it (`policy.dtensor_cfg`), the key, and
    what it most likely meant (None when nothing is close)."""

    parent: str
    key: str
    hint: str | None


def split_unknown_keys(mapping: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[UnknownKey, ...]]:
    """(a copy of a policy mapping without the keys no config class has, those keys). Values are
    left to the converter: a value of the wrong type is not walked into."""
    found: list[UnknownKey] = []
    return _drop(mapping, PolicyConfig, "policy", found), tuple(found)


def drop_unknown_keys(mapping: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(a copy of a policy mapping without the keys no config class has, one line per dropped
    key: its dotted path and, when one is likely, what it meant)."""
    cleaned, unknown = split_unknown_keys(mapping)
    lines = tuple(f"{k.parent}.{k.key}" + (f" ({k.hint})" if k.hint else "") for k in unknown)
    return cleaned, lines


def _drop(
    node: Mapping[str, Any], cls: type[Any], path: str, found: list[UnknownKey]
) -> dict[str, Any]:
    fields = {a.name: a for a in attrs.fields(cls)}
    kept: dict[str, Any] = {}
    for key, value in node.items():
        if key == "enabled" and cls in SECTIONS:
            kept[key] = value
            continue
        attribute = fields.get(key)
        if attribute is None:
            found.append(UnknownKey(path, str(key), unknown_key_hint(cls, str(key), path)))
            continue
        inner = _attrs_class(attribute.type)
        if inner is SchedulerConfig:
            value = _drop_scheduler(value, f"{path}.{key}", found)
        elif inner is not None and isinstance(value, Mapping):
            value = _drop(cast(Mapping[str, Any], value), inner, f"{path}.{key}", found)
        kept[key] = value
    return kept


def _drop_scheduler(value: Any, path: str, found: list[UnknownKey]) -> Any:
    if isinstance(value, Mapping):
        return _drop(cast(Mapping[str, Any], value), SchedulerEntry, path, found)
    if not isinstance(value, list):
        return value
    items: list[Any] = []
    for index, item in enumerate(cast(list[Any], value)):
        where = f"{path}[{index}]"
        if not isinstance(item, Mapping):
            items.append(item)
            continue
        entry = cast(Mapping[str, Any], item)
        if "milestones" in entry:
            found += [UnknownKey(where, str(key), None) for key in entry if key != "milestones"]
            items.append({"milestones": entry["milestones"]})
        else:
            mine: list[UnknownKey] = []
            items.append(_drop(entry, SchedulerEntry, where, mine))
            # an item may be the {milestones: [...]} one with that key misspelt
            found += [
                UnknownKey(k.parent, k.key, "did you mean 'milestones'?")
                if k.hint is None and closest_key(k.key, ["milestones"])
                else k
                for k in mine
            ]
    return items


def _attrs_class(type_: Any) -> type[Any] | None:
    """The config class a field holds (`X` or `X | None`), or None."""
    candidates = [type_, *get_args(type_)]
    for candidate in candidates:
        if isinstance(candidate, type) and attrs.has(candidate):
            return candidate
    return None

"""The ways in and out: `load_config(mapping)` and `config_to_dict(cfg)`, and the lenient
reading (`strict=False`) that drops unknown keys with one warning."""

import logging
import warnings
from collections.abc import Mapping
from typing import Any, cast, get_args

import attrs

from policyworker.config.converter import converter
from policyworker.config.messages import unknown_key_hint
from policyworker.config.nemo_rl_keys import split_ignored_keys
from policyworker.config.policy import PolicyConfig, structure_policy
from policyworker.config.rules import ConfigWarning, describe
from policyworker.config.sections import SECTIONS, SchedulerConfig, SchedulerEntry
from policyworker.errors import ConfigError

__all__ = ["config_to_dict", "drop_unknown_keys", "load_config"]

logger = logging.getLogger("policyworker")


def load_config(mapping: Mapping[str, Any], *, strict: bool = True) -> PolicyConfig:
    """Structure a plain mapping (e.g. NeMo-RL's `policy:` block) into a PolicyConfig.

    `strict=False` drops the keys no config class has (at any depth) and names them in one
    `ConfigWarning`, each with its did-you-mean; values are checked as strictly as ever.

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
    if not strict:
        cleaned, unknown = drop_unknown_keys(cleaned)
        if unknown:
            warnings.warn(
                f"ignoring {len(unknown)} unknown policy key{'s' * (len(unknown) != 1)} "
                f"(strict=False): {'; '.join(unknown)}; fix or remove them, or load with "
                "strict=True to make them errors",
                ConfigWarning,
                stacklevel=2,
            )
    return structure_policy(cleaned)


def config_to_dict(cfg: PolicyConfig) -> dict[str, Any]:
    """Plain JSON-able mapping (NeMo-RL key names) with `load_config(config_to_dict(c)) == c`."""
    result: dict[str, Any] = converter.unstructure(cfg)
    return result


def drop_unknown_keys(mapping: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(a copy of a policy mapping without the keys no config class has, one line per dropped
    key: its dotted path and, when one is likely, what it meant). Values are left to the
    converter: a value of the wrong type is not walked into."""
    found: list[str] = []
    return _drop(mapping, PolicyConfig, "policy", found), tuple(found)


def _drop(node: Mapping[str, Any], cls: type[Any], path: str, found: list[str]) -> dict[str, Any]:
    fields = {a.name: a for a in attrs.fields(cls)}
    kept: dict[str, Any] = {}
    for key, value in node.items():
        if key == "enabled" and cls in SECTIONS:
            kept[key] = value
            continue
        attribute = fields.get(key)
        if attribute is None:
            hint = unknown_key_hint(cls, str(key), path)
            found.append(f"{path}.{key}" + (f" ({hint})" if hint else ""))
            continue
        inner = _attrs_class(attribute.type)
        if inner is SchedulerConfig:
            value = _drop_scheduler(value, f"{path}.{key}", found)
        elif inner is not None and isinstance(value, Mapping):
            value = _drop(cast(Mapping[str, Any], value), inner, f"{path}.{key}", found)
        kept[key] = value
    return kept


def _drop_scheduler(value: Any, path: str, found: list[str]) -> Any:
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
            found += [f"{where}.{key}" for key in entry if key != "milestones"]
            items.append({"milestones": entry["milestones"]})
        else:
            items.append(_drop(entry, SchedulerEntry, where, found))
    return items


def _attrs_class(type_: Any) -> type[Any] | None:
    """The config class a field holds (`X` or `X | None`), or None."""
    candidates = [type_, *get_args(type_)]
    for candidate in candidates:
        if isinstance(candidate, type) and attrs.has(candidate):
            return candidate
    return None

# pyright: basic
"""Command-line overrides on plain mappings: `dotted.key=value`, the value read as a YAML scalar
(or flow list/mapping)."""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from policyworker.config.documents import parse_scalar
from policyworker.errors import ConfigError

__all__ = ["apply_overrides", "parse_override"]


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """`"a.b=c"` -> (("a", "b"), c), the value read as a YAML scalar (or flow list/mapping)."""
    key, sep, raw = text.partition("=")
    key = key.strip().removeprefix("policy.")
    parts = tuple(key.split("."))
    if not sep or not key or any(not part for part in parts):
        msg = (
            f"override {text!r} must look like dotted.key=value "
            "(e.g. dtensor_cfg.tensor_parallel_size=2)"
        )
        raise ConfigError(msg)
    try:
        value = parse_scalar(raw)
    except yaml.YAMLError as exc:
        msg = f"override {text!r}: the value is not a YAML value: {exc}"
        raise ConfigError(msg) from None
    return parts, value


def apply_overrides(mapping: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a new dict with each `dotted.key=value` set (missing parents are created)."""
    result = dict(mapping)
    for text in overrides:
        parts, value = parse_override(text)
        result = _set_path(result, parts, value, text=text)
    return result


def _set_path(
    node: Mapping[str, Any], parts: Sequence[str], value: Any, *, text: str
) -> dict[str, Any]:
    copy = dict(node)
    head, rest = parts[0], parts[1:]
    if not rest:
        copy[head] = value
        return copy
    child = copy.get(head)
    if child is None:
        child = {}
    if not isinstance(child, Mapping):
        msg = (
            f"override {text!r}: {head!r} holds {child!r}, not a mapping, so it has no key "
            f"{rest[0]!r}; override {head!r} itself instead"
        )
        raise ConfigError(msg)
    below: Mapping[str, Any] = child
    copy[head] = _set_path(below, rest, value, text=text)
    return copy

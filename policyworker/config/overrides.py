# pyright: basic
"""Command-line overrides on plain mappings, in Hydra's grammar (as NeMo-RL parses them):

    dotted.key=value     set a key that exists (an error if it does not, with a did-you-mean)
    +dotted.key=value    add a key that does not exist yet (an error if it does; missing
                         parents are created)
    ++dotted.key=value   set the key whether or not it exists
    ~dotted.key          delete the key (an error if it does not exist)
    ~dotted.key=value    delete the key only if it holds that value

The value is read as a YAML scalar (or flow list/mapping); a leading `policy.` is dropped. A bad
override raises `OverrideError` naming the override, the rule it broke and the fix.
"""

import difflib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import yaml
from attrs import frozen

from policyworker.config.documents import parse_scalar
from policyworker.errors import ConfigError

__all__ = ["Override", "OverrideError", "apply_overrides", "parse_override", "read_override"]

OverrideOp = Literal["set", "add", "force", "delete"]
_PREFIXES: tuple[tuple[str, OverrideOp], ...] = (("++", "force"), ("+", "add"), ("~", "delete"))
_NO_VALUE = object()


class OverrideError(ConfigError):
    """An override is malformed or cannot apply to the config it is given."""


@frozen
class Override:
    """One parsed override: `op`, the key's `path`, and `value` (`None` with `has_value` false
    for a bare `~key`)."""

    op: OverrideOp
    path: tuple[str, ...]
    value: Any = None
    has_value: bool = True


def _form_error(text: str) -> OverrideError:
    return OverrideError(
        f"override {text!r} must look like dotted.key=value, +dotted.key=value (add a new key), "
        "++dotted.key=value (set or add) or ~dotted.key[=value] (delete), e.g. "
        "dtensor_cfg.tensor_parallel_size=2"
    )


def read_override(text: str) -> Override:
    """Parse one override (see the module docstring for the grammar)."""
    op: OverrideOp = "set"
    body = text.strip()
    for prefix, name in _PREFIXES:
        if body.startswith(prefix):
            op, body = name, body[len(prefix) :]
            break
    key, sep, raw = body.partition("=")
    key = key.strip().removeprefix("policy.")
    parts = tuple(key.split("."))
    if not key or any(not part for part in parts) or key[0] in "+~" or (not sep and op != "delete"):
        raise _form_error(text)
    if not sep:
        return Override(op, parts, None, has_value=False)
    try:
        value = parse_scalar(raw)
    except yaml.YAMLError as exc:
        msg = f"override {text!r}: the value is not a YAML value ({exc}); quote it or fix it"
        raise OverrideError(msg) from None
    return Override(op, parts, value)


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """`"a.b=c"` -> (("a", "b"), c): the key's path and value of any override form
    (`read_override` also gives the operation)."""
    parsed = read_override(text)
    return parsed.path, parsed.value


def apply_overrides(mapping: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a new dict with each override applied in order (`mapping` is not changed)."""
    result = dict(mapping)
    for text in overrides:
        result = _apply(result, read_override(text), 0, text)
    return result


def _apply(node: Mapping[str, Any], override: Override, depth: int, text: str) -> dict[str, Any]:
    """`node` (the mapping at `override.path[:depth]`) with the override applied below it."""
    copy = dict(node)
    head = override.path[depth]
    if override.op == "set" and (
        head not in copy or copy[head] is None and depth + 1 < len(override.path)
    ):
        raise _missing_key(override, depth, list(copy), text)
    if depth + 1 < len(override.path):
        child = copy.get(head)
        if child is None and override.op != "delete":
            child = {}
        if not isinstance(child, Mapping) and override.op == "delete":
            raise _nothing_to_delete(override, text)
        if not isinstance(child, Mapping):
            where = ".".join(override.path[: depth + 1])
            what = "is absent" if head not in copy else f"holds {child!r}, not a mapping,"
            msg = (
                f"override {text!r}: {where!r} {what} so it has no key "
                f"{override.path[depth + 1]!r}; override {where!r} itself instead"
            )
            raise OverrideError(msg)
        copy[head] = _apply(child, override, depth + 1, text)
        return copy
    return _apply_leaf(copy, override, text)


def _missing_key(override: Override, depth: int, known: list[str], text: str) -> OverrideError:
    dotted = ".".join(override.path)
    missing = ".".join(override.path[: depth + 1])
    head = override.path[depth]
    if head in known:  # present but null: nothing below it to set
        what = f"{missing!r} is null"
    else:
        close = difflib.get_close_matches(head, known, n=1, cutoff=0.6)
        hint = f" (did you mean {'.'.join((*override.path[:depth], close[0]))!r}?)" if close else ""
        what = f"the config has no key {missing!r}{hint}"
    return OverrideError(
        f"override {text!r}: could not override {dotted!r}: {what}; a plain key=value only "
        f"sets an existing key, as in Hydra; to add it write '+{dotted}=...'"
    )


def _nothing_to_delete(override: Override, text: str) -> OverrideError:
    return OverrideError(
        f"override {text!r}: there is no key {'.'.join(override.path)!r} to delete; check its "
        "spelling or drop the override"
    )


def _apply_leaf(copy: dict[str, Any], override: Override, text: str) -> dict[str, Any]:
    head, dotted = override.path[-1], ".".join(override.path)
    if override.op == "add" and head in copy:
        msg = (
            f"override {text!r}: {dotted!r} already exists (it holds {copy[head]!r}) and '+' "
            f"only adds a new key; write '++{dotted}=...' to set it either way"
        )
        raise OverrideError(msg)
    if override.op != "delete":
        copy[head] = override.value
        return copy
    if head not in copy:
        raise _nothing_to_delete(override, text)
    if override.has_value and copy[head] != override.value:
        msg = (
            f"override {text!r}: {dotted!r} holds {copy[head]!r}, not {override.value!r}, and "
            f"'~key=value' deletes only a matching value; write '~{dotted}' to delete it "
            "whatever it holds"
        )
        raise OverrideError(msg)
    del copy[head]
    return copy

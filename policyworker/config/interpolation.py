# pyright: basic
"""OmegaConf-style interpolation on plain mappings: absolute (`${policy.model_name}`) and relative
(`${.temperature}`, `${..model_name}`) references, and the resolvers mul/add/max/min/div."""

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policyworker.config.documents import parse_scalar
from policyworker.errors import ConfigError

__all__ = ["resolve_interpolations", "resolve_subtree"]


_RESOLVERS: dict[str, Callable[[list[Any]], Any]] = {
    "mul": lambda args: math.prod(args),
    "add": lambda args: sum(args),
    "max": lambda args: max(args),
    "min": lambda args: min(args),
    "div": lambda args: _divide(args),
}
_MAX_DEPTH = 32


def _divide(args: list[Any]) -> Any:
    if len(args) != 2:
        msg = f"resolver div takes two numbers (a / b), got {args!r}"
        raise ConfigError(msg)
    if args[1] == 0:
        msg = f"resolver div: {args[0]!r} / 0; the divisor must not be 0"
        raise ConfigError(msg)
    return args[0] / args[1]


def resolve_interpolations(document: Any) -> Any:
    """Resolve every `${...}` in `document` (see `resolve_subtree`)."""
    return resolve_subtree(document, ())


def resolve_subtree(document: Any, path: Sequence[str | int]) -> Any:
    """The node at `path` in `document` with its interpolations resolved as OmegaConf does.

    `${a.b}` is absolute (from the document root); `${.x}` names a sibling of the key holding the
    string, each further dot goes one level up (`${..model_name}`); list indices count as levels.
    A referenced value is resolved where it lives, not where it is referenced. Resolvers:
    mul/add/max/min/div. A string that is exactly one interpolation keeps the referenced value's
    type; interpolations inside longer strings are substituted as text. Only the subtree is
    resolved, so references elsewhere in the document (e.g. `${oc.env:...}` in `data:`) that
    the subtree does not reach are left alone.
    """
    node = document
    for depth, key in enumerate(path):
        node = _child(node, key)
        if node is _ABSENT:
            where = ".".join(map(str, path[: depth + 1]))
            msg = f"the config has no {where!r}"
            raise ConfigError(msg)
    return _resolve_node(node, document, tuple(path), 0)


_ABSENT = object()


def _child(node: Any, key: str | int) -> Any:
    if isinstance(node, Mapping):
        mapping: Mapping[Any, Any] = node
        return mapping.get(key, _ABSENT)
    if isinstance(node, list) and isinstance(key, int):
        items: list[Any] = node
        return items[key] if 0 <= key < len(items) else _ABSENT
    return _ABSENT


def _resolve_node(node: Any, root: Any, path: tuple[str | int, ...], depth: int) -> Any:
    if isinstance(node, Mapping):
        items: Mapping[Any, Any] = node
        return {k: _resolve_node(v, root, (*path, k), depth) for k, v in items.items()}
    if isinstance(node, list):
        values: list[Any] = node
        return [_resolve_node(v, root, (*path, i), depth) for i, v in enumerate(values)]
    if isinstance(node, str) and "${" in node:
        return _resolve_text(node, root, path, depth)
    return node


def _resolve_text(text: str, root: Any, path: tuple[str | int, ...], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        msg = f"interpolation {text!r} nests deeper than {_MAX_DEPTH} levels (a reference cycle?)"
        raise ConfigError(msg)
    spans = _interpolation_spans(text)
    if len(spans) == 1 and spans[0] == (0, len(text)):
        return _evaluate(text[2:-1], root, path, depth + 1)
    pieces: list[str] = []
    last = 0
    for start, end in spans:
        value = _evaluate(text[start + 2 : end - 1], root, path, depth + 1)
        pieces += [text[last:start], str(value)]
        last = end
    return "".join([*pieces, text[last:]])


def _interpolation_spans(text: str) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    index = text.find("${")
    while index != -1:
        level, cursor = 0, index
        while cursor < len(text):
            if text.startswith("${", cursor):
                level, cursor = level + 1, cursor + 2
                continue
            if text[cursor] == "}":
                level -= 1
                if level == 0:
                    break
            cursor += 1
        if level != 0:
            msg = f"unbalanced interpolation in {text!r}: a '${{' has no closing '}}'"
            raise ConfigError(msg)
        spans.append((index, cursor + 1))
        index = text.find("${", cursor + 1)
    return spans


def _evaluate(inner: str, root: Any, path: tuple[str | int, ...], depth: int) -> Any:
    name, colon, arguments = inner.partition(":")
    if colon and re.fullmatch(r"[A-Za-z_][\w.]*", name.strip()):
        resolver = _RESOLVERS.get(name.strip())
        if resolver is None:
            msg = (
                f"unknown resolver {name.strip()!r} in '${{{inner}}}'; "
                f"known: {', '.join(sorted(_RESOLVERS))}"
            )
            raise ConfigError(msg)
        values = [_argument(arg, root, path, depth) for arg in _split_arguments(arguments)]
        return resolver(values)
    target, target_path = _lookup(inner.strip(), root, path)
    return _resolve_node(target, root, target_path, depth)


def _argument(text: str, root: Any, path: tuple[str | int, ...], depth: int) -> Any:
    text = text.strip()
    value = _resolve_text(text, root, path, depth) if "${" in text else parse_scalar(text)
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"resolver argument {text!r} is {value!r}, not a number"
        raise ConfigError(msg)
    return value


def _split_arguments(text: str) -> list[str]:
    parts: list[str] = []
    level, start = 0, 0
    for index, char in enumerate(text):
        if text.startswith("${", index):
            level += 1
        elif char == "}":
            level -= 1
        elif char == "," and level == 0:
            parts.append(text[start:index])
            start = index + 1
    return [*parts, text[start:]]


def _lookup(
    reference: str, root: Any, at: tuple[str | int, ...]
) -> tuple[Any, tuple[str | int, ...]]:
    """(value, its path) of `reference` seen from the string at path `at`."""
    dots = len(reference) - len(reference.lstrip("."))
    if dots:
        if dots > len(at):
            where = ".".join(map(str, at))
            msg = (
                f"interpolation '${{{reference}}}' at {where!r} goes {dots} levels up, "
                f"above the top of the config"
            )
            raise ConfigError(msg)
        base: tuple[str | int, ...] = at[: len(at) - dots]
        rest = reference[dots:]
    else:
        base, rest = (), reference
    parts = [part for part in rest.split(".") if part] if rest else []
    if (
        not dots
        and isinstance(root, Mapping)
        and "policy" not in root
        and parts
        and parts[0] == "policy"
    ):
        parts = parts[1:]  # a bare policy mapping referring to itself as `policy.`
    node, path = root, ()
    for key in base:
        node, path = _child(node, key), (*path, key)
    for depth, part in enumerate(parts):
        key: str | int = int(part) if isinstance(node, list) and part.isdigit() else part
        node, path = _child(node, key), (*path, key)
        if node is _ABSENT:
            where = ".".join(map(str, [*base, *parts[: depth + 1]]))
            msg = f"interpolation '${{{reference}}}' refers to {where!r}, which does not exist"
            raise ConfigError(msg)
    return node, path

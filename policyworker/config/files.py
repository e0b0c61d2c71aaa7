# pyright: basic
"""Config files in, provenance out: the shell side of `policyworker.config`.

`load_config_file(path, overrides=[...])` reads YAML or JSON (a bare policy mapping, or a document
with a top-level `policy:` key as NeMo-RL writes it) the way NeMo-RL reads it: `defaults:` chains
(relative to each file, recursive, deep merge, `_override_`), dotted overrides
(`dtensor_cfg.tensor_parallel_size=2`), then OmegaConf-style interpolations, absolute
(`${policy.model_name}`) and relative (`${.temperature}`, `${..model_name}`), with the resolvers
mul/add/max/min/div; then `load_config`. `merge_config_layers`, `apply_overrides` and
`resolve_subtree` are pure functions on plain mappings.

YAML is read with YAML 1.2 number rules, so `eps: 1e-8` is the float 1e-08 (PyYAML's YAML 1.1
rules would read it as the string "1e-8").

Why it is over 400 lines: it is one pipeline (read, ``defaults:`` chains, overrides,
interpolation, ``load_config``) that reproduces NeMo-RL's YAML semantics; the interpolation
resolver is most of it and shares the YAML 1.2 scalar rule with the reader and the overrides.
"""

import json
import logging
import math
import pathlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import yaml

from policyworker.config import PolicyConfig, config_to_dict, load_config
from policyworker.errors import ConfigError

__all__ = [
    "MISSING_VALUE",
    "apply_overrides",
    "load_config_file",
    "merge_config_layers",
    "log_config",
    "parse_override",
    "read_config_document",
    "read_config_with_defaults",
    "read_config_section",
    "resolve_interpolations",
    "resolve_subtree",
    "select_policy",
]

logger = logging.getLogger(__name__)

_YAML12_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


# libyaml's parser when PyYAML has it (NeMo-RL's configs parse ~10x faster); the resolver, and so
# the float rule below, is PyYAML's Python resolver in both cases.
_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_BaseLoader):  # type: ignore[misc, valid-type]
    """SafeLoader that reads `1e-8` and `5e3` as floats (YAML 1.2), as users expect."""


_Loader.add_implicit_resolver(  # pyright: ignore[reportUnknownMemberType]
    "tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789.")
)

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


def _parse_scalar(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (_Loader is a SafeLoader)


def read_config_document(path: str | pathlib.Path) -> Any:
    """Parse a YAML or JSON file (by suffix; anything but .json is YAML) into plain values."""
    path = pathlib.Path(path)
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (_Loader is a SafeLoader)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        msg = f"{path}: cannot parse the config file: {exc}"
        raise ConfigError(msg) from None


def select_policy(document: Any, *, source: str = "config") -> dict[str, Any]:
    """The policy mapping of a document: its `policy:` value if it has one, else the document."""
    if not isinstance(document, Mapping):
        msg = f"{source}: expected a mapping at the top level, got {type(document).__name__}"
        raise ConfigError(msg)
    body: Mapping[str, Any] = document
    policy = body.get("policy", body)
    if not isinstance(policy, Mapping):
        msg = f"{source}: `policy:` must be a mapping, got {type(policy).__name__} @ policy"
        raise ConfigError(msg)
    selected: Mapping[str, Any] = policy
    return dict(selected)


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
        value = _parse_scalar(raw)
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
    value = _resolve_text(text, root, path, depth) if "${" in text else _parse_scalar(text)
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


def read_config_with_defaults(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a config file and the files its `defaults:` names, merged as NeMo-RL merges them.

    `defaults:` is one path or a list of them, relative to the file that names it (absolute
    paths are kept); each parent is read the same way (recursively), parents are merged left to
    right and the file itself last (`merge_config_layers`). Interpolations are left as text.
    """
    return _read_with_defaults(pathlib.Path(path), ())


def _read_with_defaults(path: pathlib.Path, chain: tuple[pathlib.Path, ...]) -> dict[str, Any]:
    here = path.resolve()
    if here in chain:
        cycle = " -> ".join(str(p) for p in (*chain, here))
        msg = f"`defaults:` chain loops back to a file already being read: {cycle}"
        raise ConfigError(msg)
    document = read_config_document(path)
    if not isinstance(document, Mapping):
        msg = f"{path}: expected a mapping at the top level, got {type(document).__name__}"
        raise ConfigError(msg)
    body: dict[str, Any] = dict(document)  # pyright: ignore[reportUnknownArgumentType]
    if "defaults" not in body:
        return body
    names = body.pop("defaults")
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        msg = (
            f"{path}: `defaults:` must be a file path or a list of them, got {names!r}; "
            "write e.g. `defaults: ../../grpo_math_1B.yaml`"
        )
        raise ConfigError(msg)
    merged: dict[str, Any] = {}
    for name in names:
        parent = pathlib.Path(name) if name.startswith("/") else path.parent / name
        if not parent.is_file():
            msg = (
                f"{path}: `defaults:` names {name!r}, but {parent} is not a file (paths are "
                "relative to the file that names them)"
            )
            raise ConfigError(msg)
        merged = merge_config_layers(merged, _read_with_defaults(parent, (*chain, here)))
    return merge_config_layers(merged, body)


MISSING_VALUE = "???"


def merge_config_layers(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` deep-merged onto `base` (a new dict; neither input changes), as NeMo-RL does.

    Mappings merge key by key, recursively; any other value (lists included) replaces the old
    one; a `???` (mandatory, still missing) value does not replace an existing one. A top-level
    section whose mapping holds `_override_: true` replaces the base's section instead of merging
    into it (the marker is dropped). As in NeMo-RL, only top-level sections honour the marker.
    """
    base = dict(base)
    layer = dict(override)
    for key, value in override.items():
        if isinstance(value, Mapping) and value.get("_override_", False):
            section: dict[str, Any] = dict(value)  # pyright: ignore[reportUnknownArgumentType]
            section.pop("_override_")
            layer[key] = section
            base.pop(key, None)
    return _deep_merge(base, layer)


def _deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in override.items():
        old = result.get(key)
        if value == MISSING_VALUE and key in result:
            continue
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            result[key] = _deep_merge(old, value)  # pyright: ignore[reportUnknownArgumentType]
        else:
            result[key] = value
    return result


def read_config_section(
    path: str | pathlib.Path, section: str = "policy", *, overrides: Iterable[str] = ()
) -> dict[str, Any]:
    """The resolved `section` mapping of a config file (`policy`, `loss_fn`, `dpo`, ...):
    `defaults:` merged, the dotted `overrides` (relative to the section) applied, then
    interpolations resolved. A file without a top-level `policy` key is taken as the policy
    mapping itself; any other section must be present."""
    source = str(path)
    document: dict[str, Any] = read_config_with_defaults(path)
    if section not in document and section == "policy":
        return select_policy(
            resolve_subtree(apply_overrides(document, overrides), ()), source=source
        )
    body = document.get(section)
    if not isinstance(body, Mapping):
        msg = f"{source}: `{section}:` must be a mapping, got {type(body).__name__} @ {section}"
        raise ConfigError(msg)
    document = {**document, section: apply_overrides(body, overrides)}  # type: ignore[arg-type]
    return dict(resolve_subtree(document, (section,)))


def load_config_file(path: str | pathlib.Path, *, overrides: Iterable[str] = ()) -> PolicyConfig:
    """Read a YAML/JSON config file the way NeMo-RL does and `load_config` its policy.

    `defaults:` chains are merged, overrides are applied before interpolations are resolved (as
    NeMo-RL does), so `max_total_sequence_length=1024` also changes every
    `${policy.max_total_sequence_length}` and `${..max_total_sequence_length}`.
    """
    return load_config(read_config_section(path, "policy", overrides=overrides))


def log_config(cfg: PolicyConfig) -> str:
    """Log the config as one JSON line (a provenance record) and return that line."""
    line = json.dumps(config_to_dict(cfg), sort_keys=True, default=str)
    logger.info("policy config: %s", line)
    return line

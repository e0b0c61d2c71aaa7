"""Config files in, provenance out: the shell side of `policyworker.config`.

`load_config_file(path, overrides=[...])` reads YAML or JSON (a bare policy mapping, or a document
with a top-level `policy:` key as NeMo-RL writes it), resolves NeMo-RL's OmegaConf-style
interpolations (`${policy.model_name}`, `${mul:a,b}`, `${max:a,b}`, `${min:...}`, `${add:...}`),
applies dotted overrides (`dtensor_cfg.tensor_parallel_size=2`) and calls `load_config`.
`apply_overrides` and `resolve_interpolations` are pure functions on plain mappings.

YAML is read with YAML 1.2 number rules, so `eps: 1e-8` is the float 1e-08 (PyYAML's YAML 1.1
rules would read it as the string "1e-8").
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
    "apply_overrides",
    "load_config_file",
    "load_loss_fn_config",
    "log_config",
    "parse_override",
    "read_config_document",
    "resolve_interpolations",
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


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-8` and `5e3` as floats (YAML 1.2), as users expect."""


_Loader.add_implicit_resolver(  # pyright: ignore[reportUnknownMemberType]
    "tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789.")
)

_RESOLVERS: dict[str, Callable[[list[Any]], Any]] = {
    "mul": lambda args: math.prod(args),
    "add": lambda args: sum(args),
    "max": lambda args: max(args),
    "min": lambda args: min(args),
}
_MAX_DEPTH = 32


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
        msg = (f"override {text!r} must look like dotted.key=value "
               "(e.g. dtensor_cfg.tensor_parallel_size=2)")
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
        msg = (f"override {text!r}: {head!r} holds {child!r}, not a mapping, so it has no key "
               f"{rest[0]!r}; override {head!r} itself instead")
        raise ConfigError(msg)
    below: Mapping[str, Any] = child
    copy[head] = _set_path(below, rest, value, text=text)
    return copy


def resolve_interpolations(document: Any, *, root: Any = None) -> Any:
    """Resolve `${dotted.path}` references (absolute, from `root`, default the document) and the
    NeMo-RL resolvers mul/add/max/min. A string that is exactly one interpolation keeps the
    referenced value's type; interpolations inside longer strings are substituted as text."""
    base = document if root is None else root
    return _resolve_node(document, base, 0)


def _resolve_node(node: Any, root: Any, depth: int) -> Any:
    if isinstance(node, Mapping):
        items: Mapping[Any, Any] = node
        return {key: _resolve_node(value, root, depth) for key, value in items.items()}
    if isinstance(node, list):
        values: list[Any] = node
        return [_resolve_node(value, root, depth) for value in values]
    if isinstance(node, str) and "${" in node:
        return _resolve_text(node, root, depth)
    return node


def _resolve_text(text: str, root: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        msg = f"interpolation {text!r} nests deeper than {_MAX_DEPTH} levels (a reference cycle?)"
        raise ConfigError(msg)
    spans = _interpolation_spans(text)
    if len(spans) == 1 and spans[0] == (0, len(text)):
        return _evaluate(text[2:-1], root, depth + 1)
    pieces: list[str] = []
    last = 0
    for start, end in spans:
        pieces += [text[last:start], str(_evaluate(text[start + 2 : end - 1], root, depth + 1))]
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


def _evaluate(inner: str, root: Any, depth: int) -> Any:
    name, colon, arguments = inner.partition(":")
    if colon and re.fullmatch(r"[A-Za-z_]\w*", name.strip()):
        resolver = _RESOLVERS.get(name.strip())
        if resolver is None:
            msg = (f"unknown resolver {name.strip()!r} in '${{{inner}}}'; "
                   f"known: {', '.join(sorted(_RESOLVERS))}")
            raise ConfigError(msg)
        values = [_argument(arg, root, depth) for arg in _split_arguments(arguments)]
        return resolver(values)
    return _resolve_node(_lookup(inner.strip(), root), root, depth)


def _argument(text: str, root: Any, depth: int) -> Any:
    text = text.strip()
    value = _resolve_text(text, root, depth) if "${" in text else _parse_scalar(text)
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


def _lookup(path: str, root: Any) -> Any:
    node = root
    parts = path.split(".")
    if isinstance(root, Mapping) and "policy" not in root and parts[0] == "policy":
        parts = parts[1:]  # a bare policy mapping referring to itself as `policy.`
    for depth, part in enumerate(parts):
        if not isinstance(node, Mapping) or part not in node:
            where = ".".join(parts[: depth + 1])
            msg = f"interpolation '${{{path}}}' refers to {where!r}, which does not exist"
            raise ConfigError(msg)
        mapping: Mapping[str, Any] = node
        node = mapping[part]
    return node


def load_config_file(path: str | pathlib.Path, *, overrides: Iterable[str] = ()) -> PolicyConfig:
    """Read a YAML/JSON config file, apply overrides, resolve interpolations, `load_config` it.

    Overrides are applied before interpolations are resolved (as NeMo-RL does), so
    `max_total_sequence_length=1024` also changes every `${policy.max_total_sequence_length}`.
    """
    source = str(path)
    document = read_config_document(path)
    policy = apply_overrides(select_policy(document, source=source), overrides)
    if isinstance(document, Mapping) and "policy" in document:
        body: Mapping[str, Any] = document
        document = {**body, "policy": policy}
    else:
        document = policy
    return load_config(select_policy(resolve_interpolations(document), source=source))


def load_loss_fn_config(path: str | pathlib.Path, *, section: str = "loss_fn") -> dict[str, Any]:
    """The `loss_fn:` block of a NeMo-RL YAML/JSON file, interpolations resolved, as a mapping.

    Pass it to the loss class it configures: `ClippedPGLossFn(load_loss_fn_config(path))`
    (NeMo-RL's GRPO `loss_fn:`), or `DPOLossFn(load_loss_fn_config(path, section="dpo"))`
    (NeMo-RL keeps the DPO loss keys in its `dpo:` block). The loss class checks the keys and
    names any it does not know.
    """
    document = resolve_interpolations(read_config_document(path))
    block = document.get(section) if isinstance(document, Mapping) else None
    if not isinstance(block, Mapping):
        found = sorted(document) if isinstance(document, Mapping) else type(document).__name__
        msg = (f"{path}: no `{section}:` mapping at the top level (found {found}); add the "
               f"block or pass section= naming the one that holds the loss keys")
        raise ConfigError(msg)
    return dict(block)


def log_config(cfg: PolicyConfig) -> str:
    """Log the config as one JSON line (a provenance record) and return that line."""
    line = json.dumps(config_to_dict(cfg), sort_keys=True, default=str)
    logger.info("policy config: %s", line)
    return line

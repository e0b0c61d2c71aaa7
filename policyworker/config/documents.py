# pyright: basic
"""Reading config documents: YAML (with YAML 1.2 number rules, so `eps: 1e-8` is the float 1e-08
where PyYAML's YAML 1.1 rules would read the string "1e-8") or JSON, and the `policy:` mapping of
a document."""

import json
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import yaml

from policyworker.errors import ConfigError

__all__ = ["parse_scalar", "read_config_document", "select_policy"]

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


def parse_scalar(text: str) -> Any:
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

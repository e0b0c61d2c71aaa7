# pyright: basic
"""Config files in, provenance out: the shell side of `policyworker.config`.

`load_config_file(path, overrides=[...])` reads YAML or JSON (a bare policy mapping, or a document
with a top-level `policy:` key as NeMo-RL writes it) the way NeMo-RL reads it: `defaults:` chains
(relative to each file, recursive, deep merge, `_override_`), Hydra-style overrides
(`dtensor_cfg.tensor_parallel_size=2`), then OmegaConf-style interpolations, absolute
(`${policy.model_name}`) and relative (`${.temperature}`, `${..model_name}`), with the resolvers
mul/add/max/min/div; then `load_config`. `merge_config_layers`, `apply_overrides` and
`resolve_subtree` are pure functions on plain mappings.

The pieces: `documents` (YAML 1.2 / JSON reading), `overrides`, `interpolation`; this module
holds the `defaults:` chains and the pipeline.
"""

import json
import logging
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from policyworker.config.documents import read_config_document, select_policy
from policyworker.config.interpolation import resolve_interpolations, resolve_subtree
from policyworker.config.loading import config_to_dict, load_config
from policyworker.config.overrides import (
    OverrideError,
    apply_overrides,
    parse_override,
    read_override,
)
from policyworker.config.policy import PolicyConfig
from policyworker.errors import ConfigError

__all__ = [
    "MISSING_VALUE",
    "OverrideError",
    "apply_overrides",
    "load_config_file",
    "merge_config_layers",
    "log_config",
    "parse_override",
    "read_override",
    "read_config_document",
    "read_config_with_defaults",
    "read_config_section",
    "resolve_interpolations",
    "resolve_subtree",
    "select_policy",
]

logger = logging.getLogger(__name__)


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


def load_config_file(
    path: str | pathlib.Path, *, overrides: Iterable[str] = (), strict: bool = False
) -> PolicyConfig:
    """Read a YAML/JSON config file the way NeMo-RL does and `load_config` its policy.

    `defaults:` chains are merged, overrides are applied before interpolations are resolved (as
    NeMo-RL does), so `max_total_sequence_length=1024` also changes every
    `${policy.max_total_sequence_length}` and `${..max_total_sequence_length}`. `strict=False`
    drops unknown keys with one `ConfigWarning` (see `load_config`).
    """
    return load_config(read_config_section(path, "policy", overrides=overrides), strict=strict)


def log_config(cfg: PolicyConfig) -> str:
    """Log the config as one JSON line (a provenance record) and return that line."""
    line = json.dumps(config_to_dict(cfg), sort_keys=True, default=str)
    logger.info("policy config: %s", line)
    return line

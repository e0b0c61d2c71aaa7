"""NeMo-RL's config-file names: `load_config(path)` (an OmegaConf `DictConfig`, `defaults:`
chains merged), `register_omegaconf_resolvers()`, `parse_hydra_overrides(cfg, overrides)` and
`OverridesError`. These need `omegaconf` (NeMo-RL's own config library), which policyworker
does not depend on; without it they raise ImportError naming it. `policyworker.config.files`
reads the same files into plain mappings with nothing extra installed."""

import importlib
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

from policyworker.config.files import apply_overrides, read_config_with_defaults

__all__ = [
    "OverridesError",
    "load_config",
    "parse_hydra_overrides",
    "register_omegaconf_resolvers",
]

# The resolvers NeMo-RL registers, by name.
_RESOLVERS: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": max,
    "min": min,
}


class OverridesError(Exception):
    """An override could not be parsed or applied (NeMo-RL's name)."""


def _omegaconf() -> Any:
    try:
        return importlib.import_module("omegaconf")
    except ImportError:
        msg = (
            "policyworker.nemo_rl's config faces return OmegaConf objects and need the omegaconf "
            "package (pip install omegaconf); without it use "
            "policyworker.config.files.read_config_with_defaults(path) for the mapping, or "
            "load_config_file(path, overrides=[...]) for a PolicyConfig"
        )
        raise ImportError(msg) from None


def register_omegaconf_resolvers() -> None:
    """Register NeMo-RL's `add`/`mul`/`div`/`max`/`min` resolvers (those already registered
    are left alone)."""
    omegaconf = _omegaconf()
    for name, fn in _RESOLVERS.items():
        if not omegaconf.OmegaConf.has_resolver(name):
            omegaconf.OmegaConf.register_new_resolver(name, fn)


def load_config(config_path: str | pathlib.Path) -> Any:
    """The file as a `DictConfig`, its `defaults:` chain merged (interpolations left lazy)."""
    omegaconf = _omegaconf()
    return omegaconf.OmegaConf.create(read_config_with_defaults(config_path))


def parse_hydra_overrides(cfg: Any, overrides: Iterable[str]) -> Any:
    """A new `DictConfig`: `cfg` with the overrides applied in Hydra's grammar.

    Raises:
        OverridesError: a malformed override or one that cannot apply (the cause is chained).
    """
    omegaconf = _omegaconf()
    plain = omegaconf.OmegaConf.to_container(cfg, resolve=False)
    try:
        return omegaconf.OmegaConf.create(apply_overrides(plain, list(overrides)))
    except ValueError as exc:
        msg = f"Failed to parse Hydra overrides: {exc}"
        raise OverridesError(msg) from exc

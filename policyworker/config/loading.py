"""The ways in and out: `load_config(mapping)` and `config_to_dict(cfg)`."""

import logging
from collections.abc import Mapping
from typing import Any

from cattrs.errors import ClassValidationError, IterableValidationError

from policyworker.config.converter import converter
from policyworker.config.messages import error_lines
from policyworker.config.nemo_rl_keys import split_ignored_keys
from policyworker.config.policy import PolicyConfig
from policyworker.config.rules import describe
from policyworker.errors import ConfigError

__all__ = ["config_to_dict", "load_config"]

logger = logging.getLogger("policyworker")


def load_config(mapping: Mapping[str, Any]) -> PolicyConfig:
    """Structure a plain mapping (e.g. NeMo-RL's `policy:` block) into a PolicyConfig.

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
    try:
        return converter.structure(cleaned, PolicyConfig)
    except (ClassValidationError, IterableValidationError, ValueError) as exc:
        lines = error_lines(exc, "policy", None)
        msg = f"invalid policy config ({len(lines)} problem{'s' * (len(lines) != 1)}):\n  "
        raise ConfigError(msg + "\n  ".join(lines)) from None


def config_to_dict(cfg: PolicyConfig) -> dict[str, Any]:
    """Plain JSON-able mapping (NeMo-RL key names) with `load_config(config_to_dict(c)) == c`."""
    result: dict[str, Any] = converter.unstructure(cfg)
    return result

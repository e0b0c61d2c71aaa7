"""Validation rules of the config: the single-field `Rule`s the classes use as attrs validators,
and the two errors a broken rule raises (one value, or a class's cross-field rules)."""

import re
from collections.abc import Callable, Sequence
from typing import Any, get_args

import attrs
from attrs import frozen

from policyworker.config.values import LoraComputeDtype
from policyworker.errors import ConfigError
from policyworker.functional.lora import validate_target_entries

__all__ = [
    "ADAPTER_NAMES",
    "DOTTED_PATH",
    "LORA_COMPUTE_DTYPE",
    "MODULE_PATTERNS",
    "NON_EMPTY",
    "POSITIVE",
    "ConfigWarning",
    "InvalidValueError",
    "Rule",
    "RuleViolationsError",
    "at_least",
    "describe",
    "join_path",
    "raise_if_problems",
]


class ConfigWarning(UserWarning):
    """A config is valid but something in it is ignored or has no effect."""


class InvalidValueError(ValueError):
    """A single value broke a rule; the message already says what, the value and the rule."""


class RuleViolationsError(ConfigError):
    """Cross-field rules of one config class failed; `problems` holds (relative path, message)."""

    def __init__(self, problems: Sequence[tuple[str, str]], *, root: str) -> None:
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        lines = [f"{message} @ {join_path(root, rel)}" for rel, message in self.problems]
        super().__init__("invalid policy config:\n  " + "\n  ".join(lines))


def join_path(root: str, rel: str) -> str:
    return f"{root}.{rel}" if rel else root


def raise_if_problems(problems: list[tuple[str, str]], *, root: str) -> None:
    if problems:
        raise RuleViolationsError(problems, root=root)


def describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


@frozen
class Rule:
    """An attrs validator: `test(value)` must hold (None always passes: optional fields)."""

    test: Callable[[Any], bool]
    rule: str
    fix: str = ""

    def __call__(self, _instance: object, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if value is None:
            return
        try:
            ok = self.test(value)
        except TypeError:
            ok = False
        if not ok:
            fix = f"; {self.fix}" if self.fix else ""
            raise InvalidValueError(f"{attribute.name} = {value!r} {self.rule}{fix}")


def at_least(minimum: int) -> Rule:
    return Rule(lambda v: v >= minimum, f"must be >= {minimum}")


POSITIVE = Rule(lambda v: v > 0, "must be > 0")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
DOTTED_PATH = Rule(
    lambda v: _DOTTED.fullmatch(v) is not None,
    "must be a dotted import path",
    "write it like torch.optim.AdamW",
)
NON_EMPTY = Rule(lambda v: len(v) > 0, "must not be empty")


def _valid_module_pattern(entry: str) -> bool:
    try:
        validate_target_entries([entry], what="entry")
    except ValueError:
        return False
    return True


MODULE_PATTERNS = Rule(
    lambda v: all(_valid_module_pattern(e) for e in v),
    "must hold module names, wildcards like '*_proj' or 're:<regex>' full-match patterns",
    "remove empty entries and fix the regular expression",
)


LORA_COMPUTE_DTYPE = Rule(
    lambda v: v in get_args(LoraComputeDtype),
    f"must be one of {', '.join(map(repr, get_args(LoraComputeDtype)))}",
    "use 'auto' (bfloat16 on CUDA when the base layers compute in bfloat16, else float32) or "
    "name a dtype, e.g. 'bfloat16'",
)

_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
ADAPTER_NAMES = Rule(
    lambda v: len(set(v)) == len(v) and all(_ADAPTER_NAME.fullmatch(n) for n in v),
    "must be distinct names of letters, digits, '_', '.', '-' (starting with a letter or digit)",
    "rename or remove the duplicate or malformed entries, e.g. ['math', 'code']",
)

"""Error rendering: a cattrs error tree becomes one line per problem, each ending
`@ policy.<dotted.path>`; an unknown key gets the known key it most likely meant."""

import difflib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import attrs
import cattrs.v
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)

from policyworker.config.nemo_rl_keys import IGNORED_NEMO_RL_KEYS
from policyworker.config.rules import InvalidValueError, RuleViolationsError, join_path
from policyworker.config.sections import SECTIONS, LoRAConfig

__all__ = ["closest_key", "error_lines", "known_keys", "unknown_key_hint"]


def error_lines(exc: BaseException, path: str, type_: Any) -> list[str]:
    if isinstance(exc, ClassValidationError | IterableValidationError):
        lines: list[str] = []
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                lines += error_lines(sub, f"{path}.{note.name}", note.type)
            else:
                lines += error_lines(sub, f"{path}[{note.index!r}]", note.type)
        for sub in without:
            lines += error_lines(sub, path, None)
        return lines
    if isinstance(exc, RuleViolationsError):
        return [f"{message} @ {join_path(path, rel)}" for rel, message in exc.problems]
    return [f"{_message(exc, type_, path)} @ {path}"]


def known_keys(cls: Any, path: str) -> list[str]:
    """The keys a mapping at `path` (e.g. `policy.generation`) may hold: the class's fields and
    the accepted-but-unused NeMo-RL keys directly below that path."""
    names = [a.name for a in attrs.fields(cls)] if attrs.has(cls) else []
    prefix = path.removeprefix("policy").lstrip(".")
    for key in IGNORED_NEMO_RL_KEYS:
        parent, _, leaf = key.rpartition(".")
        if parent == prefix:
            names.append(leaf)
    if cls in SECTIONS:
        names.append("enabled")
    return names


def closest_key(key: str, known: list[str]) -> str | None:
    """The known key a typo most likely meant: difflib's closest, else the longest known key the
    typo starts or ends with (a short key plus a suffix, `dim_v2`, scores low in difflib)."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    stems = [k for k in known if len(k) >= 2 and (key.startswith(k) or key.endswith(k))]
    return max(stems, key=len) if stems else None


def _unknown_keys_message(exc: ForbiddenExtraKeysError, path: str) -> str:
    parts: list[str] = []
    for key in sorted(map(str, exc.extra_fields)):
        hint = unknown_key_hint(exc.cl, key, path)
        parts.append(f"{key}: {hint}" if hint else key)
    return f"extra fields found ({', '.join(parts)})"


# PEFT's `LoraConfig` spellings of our LoRA keys: a user porting a PEFT setup writes these.
_PEFT_LORA_KEYS: Final[Mapping[str, str]] = MappingProxyType(
    {"r": "dim", "lora_alpha": "alpha", "lora_dropout": "dropout"}
)


def unknown_key_hint(cls: Any, key: str, path: str) -> str | None:
    """What an unknown `key` of the mapping at `path` most likely meant, or None."""
    if cls is LoRAConfig and key in _PEFT_LORA_KEYS:
        return f"PEFT's name for {_PEFT_LORA_KEYS[key]!r}; write {_PEFT_LORA_KEYS[key]} instead"
    close = closest_key(key, known_keys(cls, path))
    return f"did you mean {close!r}?" if close else None


def _message(exc: BaseException, type_: Any, path: str = "policy") -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return _unknown_keys_message(exc, path)
    if isinstance(exc, KeyError):
        return "required field missing"
    if (
        isinstance(exc, ValueError | TypeError)
        and exc.args
        and isinstance(exc.args[0], str)
        and (isinstance(exc, InvalidValueError) or type_ is None)
    ):
        return exc.args[0]
    return cattrs.v.format_exception(exc, type_)

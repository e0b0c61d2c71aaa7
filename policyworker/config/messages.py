"""Error rendering: a cattrs error tree becomes one line per problem, each ending
`@ policy.<dotted.path>`; an unknown key gets the known key it most likely meant."""

import difflib
from typing import Any

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
from policyworker.config.sections import SECTIONS

__all__ = ["closest_key", "error_lines"]


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


def _known_keys(cls: Any, path: str) -> list[str]:
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
    known = _known_keys(exc.cl, path)
    parts: list[str] = []
    for key in sorted(map(str, exc.extra_fields)):
        close = closest_key(key, known)
        parts.append(f"{key}: did you mean {close!r}?" if close else key)
    return f"extra fields found ({', '.join(parts)})"


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

"""The one cattrs converter of the config: strict scalars, literal sets, optional sections, the
scheduler's two forms, and each field's attrs converter and validator run while structuring, so
every failing field is reported with its own path."""

from collections.abc import Callable, Mapping, Sequence
from types import NoneType, UnionType
from typing import Any, Final, Literal, Union, cast, get_args, get_origin

import attrs
import cattrs
from attrs import frozen
from cattrs.errors import (
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

from policyworker.config.rules import InvalidValueError, describe
from policyworker.config.sections import SECTIONS, SchedulerConfig, SchedulerEntry
from policyworker.config.values import PRECISION_ALIASES

__all__ = ["converter"]

converter: Final[cattrs.Converter] = cattrs.Converter(forbid_extra_keys=True)


def _structure_int(value: Any, _: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidValueError(f"expected an integer, got {describe(value)}")
    return value


def _structure_float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidValueError(f"expected a number, got {describe(value)}")
    return float(value)


def _structure_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidValueError(f"expected true or false, got {describe(value)}")
    return value


def _structure_str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise InvalidValueError(f"expected a string, got {describe(value)}")
    return value


def _structure_any_dict(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidValueError(f"expected a mapping, got {describe(value)}")
    items = cast(Mapping[Any, Any], value)
    bad = [key for key in items if not isinstance(key, str)]
    if bad:
        raise InvalidValueError(f"mapping keys must be strings, got {bad!r}")
    return dict(items)


def _structure_dict_or_none_as_empty(value: Any, type_: Any) -> dict[str, Any]:
    return {} if value is None else _structure_any_dict(value, type_)


def _structure_precision(value: Any, type_: Any) -> Any:
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        value = PRECISION_ALIASES.get(key, key)
    try:
        return _structure_literal(value, type_)
    except InvalidValueError:
        raise InvalidValueError(
            f"{value!r} is not a precision; use one of {', '.join(get_args(type_))} "
            f"(aliases: {', '.join(PRECISION_ALIASES)})"
        ) from None


def _structure_lora_compute_dtype(value: Any, type_: Any) -> Any:
    # the precision spellings (bf16, fp32, torch.float32, ...) are accepted here too
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        value = PRECISION_ALIASES.get(key, key)
    return value  # the field's validator names the value, the rule and the fix


def _structure_module_patterns(value: Any, type_: Any) -> tuple[str, ...]:
    # PEFT writes `target_modules: "all-linear"` (and accepts one module name as a string)
    if isinstance(value, str):
        if value.strip().lower().replace("_", "-") == "all-linear":
            raise InvalidValueError(
                f"{value!r} is PEFT's spelling of every linear layer; write "
                "match_all_linear: true and leave target_modules empty"
            )
        raise InvalidValueError(f"expected a list, got {describe(value)}; write [{value}]")
    return _structure_tuple(value, type_)


def _is_literal(type_: Any) -> bool:
    return get_origin(type_) is Literal


def _structure_literal(value: Any, type_: Any) -> Any:
    choices = get_args(type_)
    if not isinstance(value, str) or value not in choices:
        raise InvalidValueError(f"{value!r} is not one of {', '.join(repr(c) for c in choices)}")
    return value


def _is_homogeneous_tuple(type_: Any) -> bool:
    args = get_args(type_)
    return get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _structure_tuple(value: Any, type_: Any) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise InvalidValueError(f"expected a list, got {describe(value)}")
    element_type = get_args(type_)[0]
    hook = converter.get_structure_hook(element_type)
    items = cast(Sequence[Any], value)
    out: list[Any] = []
    errors: list[Exception] = []
    for index, item in enumerate(items):
        try:
            out.append(hook(item, element_type))
        except Exception as exc:  # collected: every problem is reported, each with its index
            exc.__notes__ = [
                *getattr(exc, "__notes__", []),
                IterableValidationNote(f"Structuring @ index {index}", index, element_type),
            ]
            errors.append(exc)
    if errors:
        # cattrs' __new__ takes (message, errors, type) but its class inherits ExceptionGroup's
        # two-argument __init__ signature in the stubs; the three-argument call is cattrs' own.
        raise IterableValidationError("While structuring a list", errors, type_)  # pyright: ignore[reportCallIssue]
    return tuple(out)


def _section_class(type_: Any) -> type[Any] | None:
    if get_origin(type_) not in (Union, UnionType):
        return None
    args = get_args(type_)
    if len(args) == 2 and args[1] is NoneType and args[0] in SECTIONS:
        section: type[Any] = args[0]
        return section
    return None


def _structure_section_factory(type_: Any) -> Callable[[Any, Any], Any]:
    section = _section_class(type_)
    assert section is not None
    names = {a.name for a in attrs.fields(section)}

    def structure(value: Any, _: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise InvalidValueError(f"expected a mapping or null, got {describe(value)}")
        body = cast(Mapping[str, Any], value)
        enabled = body.get("enabled", True)
        if not isinstance(enabled, bool):
            raise InvalidValueError(f"enabled must be true or false, got {describe(enabled)}")
        rest = {k: v for k, v in body.items() if k != "enabled"}
        if enabled:
            return converter.structure(rest, section)
        unknown = set(rest) - names
        if unknown:
            raise ForbiddenExtraKeysError("", section, unknown)
        return None

    return structure


@frozen(kw_only=True)
class _Milestones:
    milestones: tuple[int, ...]


def _structure_scheduler(value: Any, _: Any) -> SchedulerConfig | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return SchedulerConfig(entries=(converter.structure(value, SchedulerEntry),))
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidValueError(
            f"expected a {{name, kwargs}} mapping or a list of them plus one "
            f"{{milestones: [...]}}, got {describe(value)}"
        )
    items = cast(Sequence[Any], value)
    entries: list[SchedulerEntry] = []
    milestones: list[tuple[int, ...]] = []
    errors: list[Exception] = []
    for index, item in enumerate(items):
        try:
            if isinstance(item, Mapping) and "milestones" in item:
                if milestones:
                    raise InvalidValueError("a second {milestones: [...]} item; keep exactly one")
                milestones.append(converter.structure(item, _Milestones).milestones)
            else:
                entries.append(converter.structure(item, SchedulerEntry))
        except Exception as exc:  # collected: every problem is reported, each with its index
            exc.__notes__ = [
                *getattr(exc, "__notes__", []),
                IterableValidationNote(f"Structuring scheduler @ index {index}", index, object),
            ]
            errors.append(exc)
    if errors:
        # Same cattrs stub mismatch as in _structure_tuple: three arguments is cattrs' own call.
        raise IterableValidationError("While structuring policy.scheduler", errors, list)  # pyright: ignore[reportCallIssue]
    return SchedulerConfig(entries=tuple(entries), milestones=milestones[0] if milestones else ())


def _unstructure_scheduler(scheduler: SchedulerConfig) -> Any:
    entries = [converter.unstructure(entry) for entry in scheduler.entries]
    if len(entries) == 1 and not scheduler.milestones:
        return entries[0]
    return [*entries, {"milestones": list(scheduler.milestones)}]


def _is_own_attrs_class(type_: Any) -> bool:
    return (
        isinstance(type_, type)
        and attrs.has(type_)
        # the GRPO runner's run-file sections are read by the same rules as the policy's
        and type_.__module__.startswith(("policyworker.config.", "policyworker.grpo."))
    )


def _with_validator(
    hook: Callable[[Any, Any], Any], attribute: "attrs.Attribute[Any]"
) -> Callable[[Any, Any], Any]:
    """Run the field's attrs converter and validator while structuring, so each failing field is
    reported with its own path (attrs would stop at the first failing field of a class)."""

    def structure(value: Any, type_: Any) -> Any:
        result = hook(value, type_)
        # attrs' stubs type Attribute.converter as the bare generic `Converter | None`; ours are
        # plain one-argument callables (no field uses takes_self/takes_field).
        field_converter = cast(Any, attribute.converter)  # pyright: ignore[reportUnknownMemberType]
        if field_converter is not None:
            result = field_converter(result)
        if attribute.validator is not None:
            attribute.validator(None, attribute, result)
        return result

    return structure


# Fields whose YAML form is not their type's form: NeMo-RL's `hf_config_overrides: null` means
# {}, and `scheduler` is a mapping or a list with a milestones item (see SchedulerConfig). Keyed
# by class name: `PolicyConfig`'s module imports this one (its typed constructor checks its
# arguments as the mapping path does), so this one cannot import it.
_FIELD_HOOKS: Final[dict[tuple[str, str], Callable[[Any, Any], Any]]] = {
    ("PolicyConfig", "hf_config_overrides"): _structure_dict_or_none_as_empty,
    ("PolicyConfig", "precision"): _structure_precision,
    ("LoRAConfig", "compute_dtype"): _structure_lora_compute_dtype,
    ("LoRAConfig", "target_modules"): _structure_module_patterns,
    ("LoRAConfig", "exclude_modules"): _structure_module_patterns,
    ("PolicyConfig", "scheduler"): _structure_scheduler,
}


def _structure_attrs_factory(cls: Any) -> Callable[[Any, Any], Any]:
    overrides: dict[str, Any] = {}
    for attribute in attrs.fields(cls):
        hook = _FIELD_HOOKS.get((cls.__name__, attribute.name)) or converter.get_structure_hook(
            attribute.type
        )
        overrides[attribute.name] = override(struct_hook=_with_validator(hook, attribute))
    generated = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True, **overrides)

    def structure(value: Any, type_: Any) -> Any:
        if not isinstance(value, Mapping):
            raise InvalidValueError(f"expected a mapping, got {describe(value)}")
        return generated(cast(Mapping[str, Any], value), type_)

    return structure


converter.register_structure_hook(int, _structure_int)
converter.register_structure_hook(float, _structure_float)
converter.register_structure_hook(bool, _structure_bool)
converter.register_structure_hook(str, _structure_str)
converter.register_structure_hook_func(lambda t: t == dict[str, Any], _structure_any_dict)
converter.register_structure_hook_func(_is_literal, _structure_literal)
converter.register_structure_hook_func(_is_homogeneous_tuple, _structure_tuple)
converter.register_structure_hook_factory(
    lambda t: _section_class(t) is not None, _structure_section_factory
)
converter.register_structure_hook_factory(_is_own_attrs_class, _structure_attrs_factory)
converter.register_unstructure_hook(SchedulerConfig, _unstructure_scheduler)

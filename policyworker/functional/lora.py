"""LoRA math: scale, delta, exact merge/unmerge, module matching, PEFT key names, TP shard rule.

Shape legend: ``O`` out features, ``I`` in features, ``R`` LoRA rank (``dim``).
A LoRA module ``m`` holds ``m.lora_A.weight`` [R, I] and ``m.lora_B.weight`` [O, R]; its
effective weight is ``W + scale * (B @ A)``.

All functions are pure: tensors in, new tensors out; no argument is mutated.
"""

import difflib
import math
import re
from collections.abc import Iterable, Sequence

import torch

from policyworker.errors import LoRAMergeError

__all__ = [
    "PEFT_KEY_PREFIX",
    "REGEX_PREFIX",
    "DEFAULT_TARGETS",
    "assert_lora_modules_reachable",
    "from_peft_key",
    "lora_delta",
    "lora_param_names",
    "lora_scale",
    "lora_shard_dims",
    "matches_entry",
    "matches_target",
    "merge_lora_weight",
    "to_peft_key",
    "unmatched_entries",
    "unmerge_lora_weight",
    "validate_target_entries",
    "wildcard_regex",
]

PEFT_KEY_PREFIX = "base_model.model."
REGEX_PREFIX = "re:"
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_OUTPUT_HEAD = "lm_head"


def lora_scale(alpha: float, dim: int, use_rslora: bool = False) -> float:
    """``alpha / dim``, or ``alpha / sqrt(dim)`` with rank-stabilised LoRA.

    Raises:
        ValueError: ``dim`` is not a positive integer.
    """
    # the annotation is a promise; this value comes from a user's config
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:  # pyright: ignore[reportUnnecessaryIsInstance]
        msg = f"LoRA dim (rank) {dim!r} must be an integer >= 1; set lora_cfg.dim to e.g. 8"
        raise ValueError(msg)
    return float(alpha) / (math.sqrt(dim) if use_rslora else dim)


def _check_shapes(
    lora_a_RI: torch.Tensor, lora_b_OR: torch.Tensor, weight_OI: torch.Tensor | None
) -> None:
    if lora_a_RI.ndim != 2 or lora_b_OR.ndim != 2 or lora_b_OR.shape[1] != lora_a_RI.shape[0]:
        msg = (
            f"LoRA factors must be lora_a [R, I] and lora_b [O, R] with the same R; got lora_a "
            f"{tuple(lora_a_RI.shape)} and lora_b {tuple(lora_b_OR.shape)}"
        )
        raise ValueError(msg)
    if weight_OI is not None and tuple(weight_OI.shape) != (lora_b_OR.shape[0], lora_a_RI.shape[1]):
        msg = (
            f"base weight shape {tuple(weight_OI.shape)} must equal (lora_b rows, lora_a cols) = "
            f"{(lora_b_OR.shape[0], lora_a_RI.shape[1])}; are the adapters from another module?"
        )
        raise ValueError(msg)


def _accumulate_dtype(*dtypes: torch.dtype) -> torch.dtype:
    # At least fp32, never lower than any input: a float64 input must not be down-cast (STYLE 2.6).
    acc = torch.float32
    for dtype in dtypes:
        acc = torch.promote_types(acc, dtype)
    return acc


def lora_delta(
    lora_a_RI: torch.Tensor, lora_b_OR: torch.Tensor, scale: float, *, dtype: torch.dtype
) -> torch.Tensor:
    """``scale * (B @ A)`` [O, I], accumulated in at least fp32 and returned in ``dtype``."""
    _check_shapes(lora_a_RI, lora_b_OR, None)
    acc = _accumulate_dtype(lora_a_RI.dtype, lora_b_OR.dtype, dtype)
    return (scale * (lora_b_OR.to(acc) @ lora_a_RI.to(acc))).to(dtype)


def merge_lora_weight(
    weight_OI: torch.Tensor, lora_a_RI: torch.Tensor, lora_b_OR: torch.Tensor, scale: float
) -> torch.Tensor:
    """``W + scale * (B @ A)`` as a NEW tensor in W's dtype, accumulated in at least fp32.

    With ``B == 0`` the result equals ``W`` exactly in every float dtype (the fp32 round trip of a
    bf16/fp16 value is exact and adding 0 changes nothing).
    """
    _check_shapes(lora_a_RI, lora_b_OR, weight_OI)
    acc = _accumulate_dtype(weight_OI.dtype, lora_a_RI.dtype, lora_b_OR.dtype)
    merged_OI = torch.addmm(weight_OI.to(acc), lora_b_OR.to(acc), lora_a_RI.to(acc), alpha=scale)
    return merged_OI.to(weight_OI.dtype)


def unmerge_lora_weight(
    merged_OI: torch.Tensor, lora_a_RI: torch.Tensor, lora_b_OR: torch.Tensor, scale: float
) -> torch.Tensor:
    """Inverse of `merge_lora_weight`: ``W' - scale * (B @ A)`` as a NEW tensor in W''s dtype."""
    return merge_lora_weight(merged_OI, lora_a_RI, lora_b_OR, -scale)


def lora_param_names(module_name: str) -> tuple[str, str]:
    """The state-dict names of a LoRA module's adapters.

    They are ``(<m>.lora_A.weight, <m>.lora_B.weight)``.
    """
    return f"{module_name}.lora_A.weight", f"{module_name}.lora_B.weight"


def assert_lora_modules_reachable(
    lora_module_names: Iterable[str], state_dict_keys: Iterable[str]
) -> None:
    """Raise `LoRAMergeError` naming every LoRA module whose ``<name>.weight`` is not a key.

    A LoRA module whose base weight cannot be found would ship the bare base weight at refit: the
    only symptom would be a slowly growing train/inference logprob gap, so this fails loudly.
    """
    keys = set(state_dict_keys)
    missing = sorted(name for name in set(lora_module_names) if f"{name}.weight" not in keys)
    if not missing:
        return
    lines: list[str] = []
    for name in missing:
        close = difflib.get_close_matches(f"{name}.weight", sorted(keys), n=1, cutoff=0.6)
        hint = f" (closest key: {close[0]!r})" if close else ""
        lines.append(f"  {name!r}: no key {name + '.weight'!r}{hint}")
    msg = (
        f"{len(missing)} LoRA module(s) cannot be merged because their base weight is not in the "
        "state dict:\n" + "\n".join(lines) + "\nThe LoRA module names and the state dict must come "
        "from the same model with the same wrapper prefixes (_orig_mod., "
        "_checkpoint_wrapped_module., module.) stripped on both sides; fix the renaming instead "
        "of refitting, which would silently send unmerged base weights."
    )
    raise LoRAMergeError(msg)


def to_peft_key(name: str) -> str:
    """Our adapter parameter name -> PEFT's saved key (``base_model.model.<name>``)."""
    return PEFT_KEY_PREFIX + name


def from_peft_key(key: str) -> str:
    """PEFT's saved key ``base_model.model.<name>`` -> our name ``<name>``.

    The inverse of `to_peft_key`.

    Raises:
        ValueError: the key does not start with ``base_model.model.``.
    """
    if not key.startswith(PEFT_KEY_PREFIX):
        msg = (
            f"PEFT adapter key {key!r} must start with {PEFT_KEY_PREFIX!r} (the layout written by "
            "peft's save_pretrained); re-save the adapter with peft or policyworker"
        )
        raise ValueError(msg)
    return key[len(PEFT_KEY_PREFIX) :]


def validate_target_entries(entries: Sequence[str], *, what: str) -> None:
    """Check that every ``re:`` entry and every wildcard entry compiles and no entry is empty.

    Raises:
        ValueError: naming ``what`` (e.g. ``lora_cfg.target_modules``), the entry and the error.
    """
    for entry in entries:
        # the annotation is a promise; this value comes from a user's config
        if not isinstance(entry, str) or entry in ("", REGEX_PREFIX):  # pyright: ignore[reportUnnecessaryIsInstance]
            msg = f"{what} entry {entry!r} must be a non-empty module name or 're:<regex>'"
            raise ValueError(msg)
        try:
            _compile_entry(entry)
        except re.error as err:
            msg = f"{what} entry {entry!r} is not a valid regex ({err}); fix the pattern"
            raise ValueError(msg) from err


DEFAULT_TARGETS = ("*_proj",)  # Automodel's choice when no rule is given


def wildcard_regex(pattern: str) -> str:
    """Automodel's wildcard rule as a regex: a ``*`` not after a ``.`` becomes ``.*``, every
    ``.*`` then becomes ``(.*)``; the rest is taken as regex text; the match is anchored."""
    spread = re.sub(r"(?<!\.)\*", ".*", pattern)
    return "^" + spread.replace(".*", "(.*)") + "$"


def _compile_entry(entry: str) -> None:
    """Raise ``re.error`` if the entry's regex (``re:`` or wildcard) does not compile."""
    if entry.startswith(REGEX_PREFIX):
        re.compile(entry[len(REGEX_PREFIX) :])
    elif "*" in entry:
        re.compile(wildcard_regex(entry))


def matches_entry(module_name: str, entry: str) -> bool:
    """``entry`` equals the dotted name or is a dotted suffix of it (PEFT's rule), or matches it
    as an Automodel wildcard (``*_proj``, ``*.layers.0.*``); ``re:<p>`` full-matches."""
    if entry.startswith(REGEX_PREFIX):
        return re.fullmatch(entry[len(REGEX_PREFIX) :], module_name) is not None
    if module_name == entry or module_name.endswith("." + entry):
        return True
    return "*" in entry and re.match(wildcard_regex(entry), module_name) is not None


def matches_target(
    module_name: str, targets: Sequence[str], excludes: Sequence[str], *, match_all_linear: bool
) -> bool:
    """Whether a linear module named ``module_name`` gets a LoRA adapter (Automodel's order).

    1. ``match_all_linear``: every linear layer except the output head (``lm_head``);
    2. else, when ``targets`` is not empty: one of them must match;
    3. else: every linear layer (``targets`` defaults to ``*_proj`` when ``excludes`` is empty
       too, as in Automodel).
    A match of any of ``excludes`` always wins (Automodel refuses to combine the rules; here
    they compose).
    """
    if any(matches_entry(module_name, entry) for entry in excludes):
        return False
    if match_all_linear:
        return module_name.rsplit(".", 1)[-1] != _OUTPUT_HEAD
    if not targets and not excludes:
        targets = DEFAULT_TARGETS
    if targets:
        return any(matches_entry(module_name, entry) for entry in targets)
    return True


def unmatched_entries(module_names: Iterable[str], entries: Sequence[str]) -> list[str]:
    """The entries of ``entries`` that match none of ``module_names`` (in their given order)."""
    names = list(module_names)
    return [entry for entry in entries if not any(matches_entry(name, entry) for name in names)]


def lora_shard_dims(base_shard_dim: int | None) -> tuple[int | None, int | None]:
    """Tensor-parallel rule: the adapters follow the base weight's layout.

    ``W`` [O, I] sharded on dim 0 (column-wise, out features) -> ``B`` [O, R] sharded on dim 0 and
    ``A`` replicated, so ``B_k @ A`` is exactly shard k of ``B @ A``. ``W`` sharded on dim 1
    (row-wise, in features) -> ``A`` [R, I] sharded on dim 1 and ``B`` replicated, so
    ``B @ A_k`` is shard k of ``B @ A``. A replicated base keeps both adapters replicated.

    Returns:
        ``(lora_a_shard_dim, lora_b_shard_dim)``, ``None`` meaning replicated.
    """
    if base_shard_dim is None:
        return None, None
    if base_shard_dim in (0, -2):
        return None, 0
    if base_shard_dim in (1, -1):
        return 1, None
    msg = f"base weight shard dim {base_shard_dim} is invalid for a 2-D linear weight; use 0 or 1"
    raise ValueError(msg)

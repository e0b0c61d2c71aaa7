"""The loss configs: ``ClippedPGConfig`` and ``DPOConfig`` (NeMo-RL's ``loss_fn`` / ``dpo`` keys
and defaults), and the reader that turns a mapping, attrs, dataclass or pydantic config into one,
listing every problem in one ``ConfigError``. All functions are pure.
"""

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import attrs

from policyworker.errors import ConfigError
from policyworker.functional.loss_terms import KLType, TruncationType

__all__ = ["ClippedPGConfig", "DPOConfig", "config_mapping", "read_config_mapping"]

_DPO_TRAINER_KEYS = frozenset(
    {
        # NeMo-RL hands its whole `dpo:` section to DPOLossFn; these keys belong to the trainer.
        "max_num_epochs",
        "max_num_steps",
        "val_period",
        "val_batches",
        "val_global_batch_size",
        "val_micro_batch_size",
        "val_at_start",
        "val_at_end",
        "seed",
    }
)


def config_mapping(cfg: Any, owner: str) -> Mapping[str, Any]:
    """A loss config as a mapping: None (all defaults), a mapping, an attrs or dataclass
    instance, or a pydantic model (NeMo-RL's ``ClippedPGLossConfig`` and friends)."""
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return cfg  # pyright: ignore[reportUnknownVariableType]
    kind: type[object] = type(cfg)  # pyright: ignore[reportUnknownVariableType] (user object)
    if attrs.has(kind):
        return attrs.asdict(cfg, recurse=False)
    dump = getattr(cfg, "model_dump", None)
    if callable(dump):
        dumped = dump()
        if isinstance(dumped, Mapping):
            return dumped  # pyright: ignore[reportUnknownVariableType]
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    msg = (
        f"{owner} config must be a mapping, an attrs/dataclass instance or a pydantic model "
        f"with its keys, got {type(cfg).__name__}; pass e.g. {owner}({{...}})"
    )
    raise ValueError(msg)


def read_config_mapping(
    cfg: Mapping[str, Any], cls: type[Any], *, section: str, ignored: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Check ``cfg`` against the fields of attrs class ``cls``; every problem in one ConfigError."""
    fields = {f.name: f for f in attrs.fields(cls)}
    problems: list[str] = []
    values: dict[str, Any] = {}
    for key, value in cfg.items():
        if key in ignored:
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.75)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"unknown key {key!r} ({hint}accepted keys: {sorted(fields)}) @ {section}.{key}"
            )
            continue
        kind = fields[key].metadata["kind"]
        if not _has_kind(value, kind):
            problems.append(f"{key} must be {kind}, got {value!r} @ {section}.{key}")
            continue
        values[key] = float(value) if kind.startswith("a number") and value is not None else value
    if problems:
        raise ConfigError("\n".join(problems))
    return values


def _has_kind(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or null")
    if kind.startswith("a bool"):
        return isinstance(value, bool)
    if kind.startswith("a number"):
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)


def _kind(kind: str, default: Any) -> Any:
    return attrs.field(default=default, metadata={"kind": kind})


def _check(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


@attrs.frozen(kw_only=True)
class ClippedPGConfig:
    """NeMo-RL's ``loss_fn`` keys for ClippedPGLossFn, with ``ClippedPGLossConfig``'s defaults.

    ``reference_policy_kl_penalty`` defaults to 0.01 as in NeMo-RL's ``ClippedPGLossConfig``.
    Deliberate differences: ``truncated_importance_sampling_ratio`` set with no type means
    ``"tis"`` (what older NeMo-RL configs, which had no type key, meant); bad values raise
    ``ConfigError`` at construction instead of asserting at the first call; unknown keys are
    errors (NeMo-RL's pydantic model allows extras).

    ``max_version_lag`` (ours, null by default): with per-token ``generation_versions`` in the
    batch, tokens whose version lag (``policy_version - generation_versions``) exceeds it are
    masked out of the loss; they still count in ``global_valid_toks`` / ``global_valid_seqs``
    (as icepop's masked tokens do), so a microbatch's loss never grows by dropping tokens.
    """

    disable_ppo_ratio: bool = _kind("a bool", False)
    token_level_loss: bool = _kind("a bool", True)
    sequence_level_importance_ratios: bool = _kind("a bool", False)
    ratio_clip_min: float = _kind("a number", 0.2)
    ratio_clip_max: float = _kind("a number", 0.2)
    ratio_clip_c: float | None = _kind("a number or null", None)
    reference_policy_kl_penalty: float = _kind("a number", 0.01)
    reference_policy_kl_type: KLType = _kind("a string", "k3")
    kl_input_clamp_value: float | None = _kind("a number or null", 20.0)
    kl_output_clamp_value: float | None = _kind("a number or null", 10.0)
    use_kl_in_reward: bool = _kind("a bool", False)
    use_importance_sampling_correction: bool = _kind("a bool", False)
    truncated_importance_sampling_type: TruncationType | None = _kind("a string or null", None)
    truncated_importance_sampling_ratio: float | None = _kind("a number or null", None)
    truncated_importance_sampling_ratio_min: float | None = _kind("a number or null", None)
    use_on_policy_kl_approximation: bool = _kind("a bool", False)
    force_on_policy_ratio: bool = _kind("a bool", False)
    use_cispo: bool = _kind("a bool", False)
    positive_example_nll_weight: float = _kind("a number", 0.0)
    max_version_lag: float | None = _kind("a number or null", None)

    @classmethod
    def from_mapping(cls, cfg: Any) -> "ClippedPGConfig":
        """Build from a NeMo-RL ``loss_fn`` mapping or config object (see `config_mapping`);
        missing keys take the defaults."""
        if isinstance(cfg, cls):
            return cfg
        values = read_config_mapping(config_mapping(cfg, "ClippedPGLossFn"), cls, section="loss_fn")
        if values.get("truncated_importance_sampling_ratio") is not None:
            values.setdefault("truncated_importance_sampling_type", "tis")
        return cls(**values)

    def __attrs_post_init__(self) -> None:
        p: list[str] = []
        _check(
            p,
            self.reference_policy_kl_type in ("k1", "k2", "k3"),
            f"reference_policy_kl_type must be 'k1', 'k2' or 'k3', got "
            f"{self.reference_policy_kl_type!r} @ loss_fn.reference_policy_kl_type",
        )
        _check(
            p,
            self.ratio_clip_c is None or self.ratio_clip_c > 1,
            f"ratio_clip_c (dual clip) must be > 1 or null, got {self.ratio_clip_c}; "
            f"3 is the usual value @ loss_fn.ratio_clip_c",
        )
        _check(
            p,
            not (self.sequence_level_importance_ratios and self.token_level_loss),
            "sequence_level_importance_ratios (GSPO) needs a sequence-level loss; set "
            "token_level_loss: false @ loss_fn.sequence_level_importance_ratios",
        )
        _check(
            p,
            self.positive_example_nll_weight >= 0,
            f"positive_example_nll_weight must be >= 0, got {self.positive_example_nll_weight} "
            f"@ loss_fn.positive_example_nll_weight",
        )
        lag = self.max_version_lag
        _check(
            p,
            lag is None or (lag >= 0 and float(lag).is_integer()),
            f"max_version_lag must be a whole number >= 0 or null, got {lag}; 0 keeps only "
            f"tokens sampled by the weights being trained @ loss_fn.max_version_lag",
        )
        p += self._truncation_problems() + self._cispo_problems()
        if p:
            raise ConfigError("\n".join(p))

    def _truncation_problems(self) -> list[str]:
        kind, hi, lo = (
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        if kind is None:
            return []
        at, p = "@ loss_fn.truncated_importance_sampling_", list[str]()
        _check(
            p,
            kind in ("tis", "icepop", "seq-mask-tis"),
            f"truncated_importance_sampling_type must be 'tis', 'icepop' or 'seq-mask-tis', "
            f"got {kind!r} {at}type",
        )
        _check(
            p,
            self.use_importance_sampling_correction,
            f"truncated importance sampling ({kind}) needs use_importance_sampling_correction: "
            f"true {at}type",
        )
        _check(
            p,
            hi is not None and hi > 0,
            f"truncated_importance_sampling_ratio must be a positive number when a "
            f"truncation type is set, got {hi} {at}ratio",
        )
        _check(
            p,
            lo is None or hi is None or lo <= hi,
            f"truncated_importance_sampling_ratio_min must be <= "
            f"truncated_importance_sampling_ratio (got {lo} > {hi}) {at}ratio_min",
        )
        _check(
            p,
            kind == "tis" or lo is not None,
            f"truncation type {kind!r} needs truncated_importance_sampling_ratio_min {at}ratio_min",
        )
        _check(
            p,
            not (kind == "seq-mask-tis" and self.sequence_level_importance_ratios),
            f"seq-mask-tis uses token-level weights; it cannot be combined with "
            f"sequence_level_importance_ratios: true {at}type",
        )
        return p

    def _cispo_problems(self) -> list[str]:
        if not self.use_cispo:
            return []
        conflicts = {
            "disable_ppo_ratio": self.disable_ppo_ratio,
            "force_on_policy_ratio": self.force_on_policy_ratio,
            "sequence_level_importance_ratios": self.sequence_level_importance_ratios,
            "ratio_clip_c": self.ratio_clip_c is not None,
            "token_level_loss: false": not self.token_level_loss,
        }
        return [
            f"use_cispo cannot be combined with {name}; turn one of them off @ loss_fn.use_cispo"
            for name, active in conflicts.items()
            if active
        ]


@attrs.frozen(kw_only=True)
class DPOConfig:
    """NeMo-RL's DPO loss keys with NeMo-RL's ``DPOLossConfig`` defaults.

    The rest of NeMo-RL's ``dpo:`` section (epochs, validation, seed) is accepted and ignored.
    """

    reference_policy_kl_penalty: float = _kind("a number", 0.05)
    preference_loss_weight: float = _kind("a number", 1.0)
    sft_loss_weight: float = _kind("a number", 0.0)
    preference_average_log_probs: bool = _kind("a bool", False)
    sft_average_log_probs: bool = _kind("a bool", False)

    @classmethod
    def from_mapping(cls, cfg: Any) -> "DPOConfig":
        """Build from a NeMo-RL ``dpo`` mapping or config object; missing keys take the
        defaults."""
        if isinstance(cfg, cls):
            return cfg
        return cls(
            **read_config_mapping(
                config_mapping(cfg, "DPOLossFn"), cls, section="dpo", ignored=_DPO_TRAINER_KEYS
            )
        )

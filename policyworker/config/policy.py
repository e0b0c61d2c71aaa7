"""`PolicyConfig`, the whole `policy` mapping, with its cross-field rules and the rule that needs
the data-parallel size (`validate_for_world`), and `structure_policy`, the one place a mapping
becomes a `PolicyConfig`: `load_config` and the typed constructor both go through it, so both
refuse the same values with the same `ConfigError`."""

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any, cast

import attrs
from attrs import field, frozen
from cattrs.errors import ClassValidationError, IterableValidationError

from policyworker.config.converter import converter
from policyworker.config.messages import error_lines
from policyworker.config.rules import (
    NON_EMPTY,
    POSITIVE,
    RuleViolationsError,
    at_least,
    raise_if_problems,
)
from policyworker.config.sections import (
    DataPlaneConfig,
    DraftConfig,
    DTensorConfig,
    DynamicBatchingConfig,
    GenerationConfig,
    OptimizerConfig,
    RewardModelConfig,
    RouterReplayConfig,
    SchedulerConfig,
    SequencePackingConfig,
    TokenizerConfig,
    empty_kwargs,
)
from policyworker.config.values import Precision
from policyworker.errors import ConfigError

__all__ = ["PolicyConfig", "structure_policy", "validate_for_world"]

# True while the converter builds a PolicyConfig: its arguments are being checked already.
_STRUCTURING: ContextVar[bool] = ContextVar("policyworker_config_structuring", default=False)


@frozen(kw_only=True)
class PolicyConfig:
    """`policy`: everything one PolicyWorker reads. Build it with `load_config(mapping)` or
    directly (`PolicyConfig(model_name=...)`): both refuse the same values with the same
    `ConfigError`.

    Optional sections: absent, `null` and `{enabled: false, ...}` all mean disabled (None); see
    the `policyworker.config` docstring. Use the `*_enabled` properties rather than testing
    sections. `disabled_sections` keeps what a `{enabled: false, ...}` section was given, by
    dotted path (`{"dtensor_cfg.lora_cfg": {"dim": 16}}`), as NeMo-RL keeps it; `config_to_dict`
    writes it back in place; it takes no part in equality (a disabled section is not read).
    The microbatch-size rules apply to fixed microbatching only: under sequence packing or
    dynamic batching `train_micro_batch_size` is not used.
    """

    model_name: str = field(validator=NON_EMPTY)
    tokenizer: TokenizerConfig = TokenizerConfig()
    precision: Precision = "bfloat16"
    train_global_batch_size: int = field(default=32, validator=at_least(1))
    train_micro_batch_size: int = field(default=1, validator=at_least(1))
    logprob_batch_size: int = field(default=8, validator=at_least(1))
    logprob_chunk_size: int | None = field(default=None, validator=at_least(1))
    max_grad_norm: float | None = field(default=1.0, validator=POSITIVE)
    offload_optimizer_for_logprob: bool = False
    make_sequence_length_divisible_by: int = field(default=1, validator=at_least(1))
    max_total_sequence_length: int | None = field(default=None, validator=at_least(1))
    hf_config_overrides: dict[str, Any] = field(factory=empty_kwargs)
    refit_buffer_size_gb: float | None = field(default=None, validator=POSITIVE)
    batch_size: int | None = field(default=None, validator=at_least(1))
    dtensor_cfg: DTensorConfig = DTensorConfig()
    sequence_packing: SequencePackingConfig | None = None
    dynamic_batching: DynamicBatchingConfig | None = None
    optimizer: OptimizerConfig | None = OptimizerConfig()
    scheduler: SchedulerConfig | None = None
    generation: GenerationConfig | None = None
    reward_model_cfg: RewardModelConfig | None = None
    router_replay: RouterReplayConfig | None = None
    draft: DraftConfig | None = None
    data_plane: DataPlaneConfig | None = None
    disabled_sections: dict[str, Any] = field(factory=empty_kwargs, eq=False)

    def __attrs_pre_init__(self, **arguments: Any) -> None:
        # `PolicyConfig(...)` checks its arguments as `load_config` checks a mapping (types,
        # literal choices, nested sections given as mappings, every field rule, all problems at
        # once), so a value the mapping path refuses is refused here with the same error.
        # (attrs passes NOTHING for a factory default the caller left out)
        if not _STRUCTURING.get():
            given = {k: v for k, v in arguments.items() if v is not attrs.NOTHING}
            structure_policy({name: converter.unstructure(v) for name, v in given.items()})

    def __attrs_post_init__(self) -> None:
        raise_if_problems(_cross_field_problems(self), root="policy")

    @property
    def tokenizer_name(self) -> str:
        """`tokenizer.name`, defaulting to `model_name`."""
        return self.model_name if self.tokenizer.name is None else self.tokenizer.name

    @property
    def sequence_packing_enabled(self) -> bool:
        return self.sequence_packing is not None

    @property
    def dynamic_batching_enabled(self) -> bool:
        return self.dynamic_batching is not None

    @property
    def lora_enabled(self) -> bool:
        return self.dtensor_cfg.lora_cfg is not None

    @property
    def reward_model_enabled(self) -> bool:
        return self.reward_model_cfg is not None

    @property
    def router_replay_enabled(self) -> bool:
        return self.router_replay is not None

    @property
    def draft_enabled(self) -> bool:
        return self.draft is not None

    @property
    def data_plane_enabled(self) -> bool:
        return self.data_plane is not None

    @property
    def fixed_microbatching(self) -> bool:
        """True when microbatches have `train_micro_batch_size` rows (no packing/dynamic)."""
        return self.sequence_packing is None and self.dynamic_batching is None


def _cross_field_problems(cfg: PolicyConfig) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    cp = cfg.dtensor_cfg.context_parallel_size
    if cfg.sequence_packing is not None and cfg.dynamic_batching is not None:
        problems.append(
            (
                "sequence_packing",
                "sequence_packing and dynamic_batching are both "
                "enabled but are exclusive; set enabled: false on one of them",
            )
        )
    if cfg.sequence_packing is not None and cp > 1:
        problems.append(
            (
                "sequence_packing",
                f"sequence packing does not support "
                f"dtensor_cfg.context_parallel_size > 1 (got {cp}); set "
                "context_parallel_size: 1 or disable sequence_packing",
            )
        )
    if cfg.sequence_packing is not None and cfg.reward_model_cfg is not None:
        problems.append(
            (
                "sequence_packing",
                "sequence packing is not supported for reward "
                "models (reward_model_cfg is enabled); disable sequence_packing",
            )
        )
    tp = cfg.dtensor_cfg.tensor_parallel_size
    if cfg.draft is not None and tp * cp != 1:
        problems.append(
            (
                "draft",
                f"draft co-training reads whole sequences and full logits on each rank: it "
                f"needs dtensor_cfg.tensor_parallel_size = 1 and context_parallel_size = 1 "
                f"(got {tp} and {cp}); use data parallelism only, or remove the draft",
            )
        )
    gbs, mbs = cfg.train_global_batch_size, cfg.train_micro_batch_size
    if cfg.fixed_microbatching and gbs % mbs != 0:
        problems.append(
            (
                "train_global_batch_size",
                f"train_global_batch_size = {gbs} must be "
                f"a multiple of train_micro_batch_size = {mbs}; change one of them",
            )
        )
    seq = cfg.max_total_sequence_length
    if cp > 1 and seq is not None and seq % (2 * cp) != 0:
        problems.append(
            (
                "max_total_sequence_length",
                f"max_total_sequence_length = {seq} must "
                f"be divisible by 2 * dtensor_cfg.context_parallel_size = {2 * cp} "
                f"(load-balanced CP chunks); use {(seq // (2 * cp) + 1) * 2 * cp}",
            )
        )
    return problems


def validate_for_world(cfg: PolicyConfig, *, dp_size: int) -> None:
    """Check the rules that need the data-parallel size; raise ConfigError naming the fix."""
    if dp_size < 1:
        msg = f"dp_size = {dp_size} must be >= 1"
        raise ValueError(msg)
    gbs, mbs = cfg.train_global_batch_size, cfg.train_micro_batch_size
    unit = dp_size * mbs if cfg.fixed_microbatching else dp_size
    if gbs % unit != 0:
        what = (
            f"dp_size * train_micro_batch_size = {dp_size} * {mbs} = {unit}"
            if cfg.fixed_microbatching
            else f"dp_size = {dp_size}"
        )
        raise RuleViolationsError(
            [
                (
                    "train_global_batch_size",
                    f"train_global_batch_size = {gbs} must be a multiple "
                    f"of {what} so every data-parallel rank gets whole microbatches; use "
                    f"{max(unit, gbs // unit * unit)}",
                )
            ],
            root="policy",
        )


# The optional sections, by dotted path below `policy`.
SECTION_PATHS: tuple[str, ...] = (
    "sequence_packing",
    "dynamic_batching",
    "dtensor_cfg.lora_cfg",
    "dtensor_cfg.fp8",
    "reward_model_cfg",
    "router_replay",
    "draft",
)


def with_disabled_sections(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """`mapping` with the values of its `{enabled: false, ...}` sections copied into
    `disabled_sections` (by dotted path), so they read back as given."""
    found: dict[str, Any] = {}
    for path in SECTION_PATHS:
        node: Any = mapping
        for part in path.split("."):
            node = cast(Mapping[str, Any], node).get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping):
            body = cast(Mapping[str, Any], node)
            if body.get("enabled", True) is False:
                found[path] = {k: v for k, v in body.items() if k != "enabled"}
    if not found:
        return mapping
    given: Any = mapping.get("disabled_sections")
    merged: dict[str, Any] = (
        {**cast(Mapping[str, Any], given), **found} if isinstance(given, Mapping) else found
    )
    return {**mapping, "disabled_sections": merged}


def place_disabled_sections(tree: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `with_disabled_sections` on an unstructured config: each kept disabled
    section goes back to its path as `{enabled: false, ...}` (unless that section is enabled)."""
    kept: dict[str, dict[str, Any]] = tree.pop("disabled_sections", None) or {}
    for path, values in kept.items():
        *parents, leaf = path.split(".")
        node: dict[str, Any] = tree
        for part in parents:
            node = node.setdefault(part, {})
        if node.get(leaf) is None:
            node[leaf] = {"enabled": False, **values}
    return tree


def structure_policy(mapping: Mapping[str, Any], *, problems: Sequence[str] = ()) -> PolicyConfig:
    """Structure a policy mapping (NeMo-RL keys already split off) into a PolicyConfig.

    `problems` are lines found before structuring (`... @ policy.<path>`); they are reported
    with the structuring's own, all in one error.

    Raises:
        ConfigError: listing every problem, one per line, each ending `@ policy.<path>`.
    """
    token = _STRUCTURING.set(True)
    lines = list(problems)
    cfg: PolicyConfig | None = None
    try:
        cfg = converter.structure(with_disabled_sections(mapping), PolicyConfig)
    except (ClassValidationError, IterableValidationError, ValueError) as exc:
        lines += error_lines(exc, "policy", None)
    finally:
        _STRUCTURING.reset(token)
    if lines or cfg is None:
        msg = f"invalid policy config ({len(lines)} problem{'s' * (len(lines) != 1)}):\n  "
        raise ConfigError(msg + "\n  ".join(lines)) from None
    return cfg

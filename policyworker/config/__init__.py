"""Typed policy configuration: frozen attrs classes, one cattrs converter, `load_config`.

`load_config(mapping)` is the one way in. It accepts NeMo-RL's `policy:` section unchanged:
the keys this worker reads are structured into the classes below (YAML keys are the attribute
names), the NeMo-RL keys it does not read (`IGNORED_NEMO_RL_KEYS`) are dropped with one
`ConfigWarning`, and anything else is an error. A bad mapping raises `ConfigError` listing every
problem, one per line, each ending `@ policy.<dotted.path>`.

Optional sections (`sequence_packing`, `dynamic_batching`, `dtensor_cfg.lora_cfg`,
`reward_model_cfg`, `router_replay`, `draft`) follow one rule: absent or `null` means disabled,
and so does NeMo-RL's `{enabled: false, ...}` form; both structure to `None`. A section given
without `enabled`, or with `enabled: true`, is enabled and structures to its class (which has no
`enabled` attribute). The keys of a disabled section are still checked by name (a typo is an
error) but their values are not read. `PolicyConfig` has `*_enabled` properties for consumers.

Why it is over 400 lines: over 1,000, in fact, because it is the style guide's
one config module (classes + the converter + `load_config`), and its three parts reference each
other both ways: the classes' validators are the `_Rule`s here, the converter's field hooks are
keyed by the classes (`_FIELD_HOOKS`), and `load_config`'s error rendering walks both. Splitting
the hooks or rules into another module would leave a module of private helpers read only from
here (or an import cycle), and pyright's strict mode is configured for this path. The
NeMo-RL ignore table is data, not logic.
"""

import difflib
import logging
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType, NoneType, UnionType
from typing import Any, Final, Literal, TypeVar, Union, cast, get_args, get_origin

import attrs
import cattrs
import cattrs.v
from attrs import field, frozen
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

from policyworker.errors import ConfigError
from policyworker.functional.lora import validate_target_entries

__all__ = [
    "IGNORED_NEMO_RL_KEYS",
    "PRECISION_ALIASES",
    "AttnImplementation",
    "ColocatedConfig",
    "ConfigWarning",
    "DTensorConfig",
    "DraftConfig",
    "DropoutPosition",
    "FusionMode",
    "DynamicBatchingConfig",
    "GenerationConfig",
    "LoRAConfig",
    "LoraAInit",
    "LoraComputeDtype",
    "MicrobatchOrder",
    "OptimizerConfig",
    "PackingAlgorithm",
    "PolicyConfig",
    "Precision",
    "RewardModelConfig",
    "RewardModelType",
    "RouterReplayConfig",
    "SchedulerConfig",
    "SchedulerEntry",
    "SequencePackingConfig",
    "TokenizerConfig",
    "config_to_dict",
    "converter",
    "load_config",
    "split_ignored_keys",
    "validate_for_world",
]

Precision = Literal["float32", "bfloat16", "float16"]
AttnImplementation = Literal["auto", "sdpa", "eager", "flex_attention", "varlen"]
# torch.compile of elementwise work in the training model (shell/kernels/fusion.py); "none"
# runs eager, "auto" is "layer" on CUDA in a single process and "none" otherwise
FusionMode = Literal["auto", "none", "norm_mlp", "layer"]
PackingAlgorithm = Literal[
    "modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative"
]
MicrobatchOrder = Literal["packer", "largest_first"]
RewardModelType = Literal["bradley_terry", "regression"]
DropoutPosition = Literal["pre", "post"]
LoraAInit = Literal["xavier", "uniform"]
# dtype of the LoRA adapter matmuls (the adapter parameters stay fp32); shell/model/lora.py resolves
# "auto": bfloat16 on CUDA when the base layers compute in bfloat16, else float32
LoraComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]

# NeMo-RL `policy.*` keys this worker accepts and does not read (dotted paths below `policy`):
# every key NeMo-RL's policy TypedDicts or its example configs define that the classes below do
# not hold. A key listed here is dropped before structuring (with its whole subtree) and named in
# one INFO record of the `policyworker` logger; every other unknown key is an error with a
# did-you-mean. The value says why it is not read (docs/config-reference.md lists them).
_ENGINE = "inference-engine settings (controller / inference side)"
_QUANT = "ModelOpt quantization (Megatron backend)"
IGNORED_NEMO_RL_KEYS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "megatron_cfg": "Megatron-Core backend settings (this is the DTensor/Automodel worker)",
        "generation_batch_size": "static-batched HF generation in the controller",
        "dequantize_base_checkpoint": "Automodel checkpoint-loader option",
        "pretrained_checkpoint": "restores Megatron checkpoints (Megatron backend only)",
        "activation_checkpointing_enabled": "legacy spelling; dtensor_cfg.activation_checkpointing "
        "is the key read",
        "is_vlm": "vision-language models are not supported by this worker",
        "quant_cfg": _QUANT,
        "quant_calib_data": _QUANT,
        "quant_calib_size": _QUANT,
        "quant_batch_size": _QUANT,
        "quant_sequence_length": _QUANT,
        "disable_modelopt_layer_spec": _QUANT,
        "tokenizer.audio": "multimodal processor options (text-only worker)",
        "tokenizer.video": "multimodal processor options (text-only worker)",
        "tokenizer.use_fastokens": "tokenization happens in the controller",
        "dtensor_cfg.enabled": "selects this worker in NeMo-RL",
        "dtensor_cfg._v2": "selects this worker in NeMo-RL",
        "dtensor_cfg.expert_parallel_size": "expert parallelism is not implemented here",
        "dtensor_cfg.dp_replicate_size": "HSDP replication is not implemented here",
        "dtensor_cfg.custom_parallel_plan": "Automodel TP plan override",
        "dtensor_cfg.defer_fsdp_grad_sync": "only affects Automodel's pipelined training",
        "dtensor_cfg.moe_parallelizer": "Automodel MoE parallelizer options",
        "dtensor_cfg.automodel_kwargs": "Automodel model-builder options",
        "dtensor_cfg.clear_cache_every_n_steps": "CUDA cache clearing cadence",
        "dtensor_cfg.env_vars": "the launcher sets the process environment",
        "sequence_packing.sequence_length_round": (
            "packing pads with make_sequence_length_divisible_by"
        ),
        "sequence_packing.fuse_loss": "Megatron fused packed loss",
        "generation.backend": "inference-engine choice (controller side)",
        "generation.max_new_tokens": "rollout length (inference side)",
        "generation.model_name": "inference-engine model (controller side)",
        "generation.stop_token_ids": "rollout stopping (inference side)",
        "generation.stop_strings": "rollout stopping (inference side)",
        "generation.bad_words": "rollout sampling (inference side)",
        "generation.val_temperature": "validation sampling (inference side)",
        "generation.val_top_k": "validation sampling (inference side)",
        "generation.val_top_p": "validation sampling (inference side)",
        "generation.port_range_low": "inference-server ports (controller side)",
        "generation.port_range_high": "inference-server ports (controller side)",
        "generation.use_async_rollouts": "rollout scheduling (controller side)",
        "generation.pad_token_id": "filled in by the controller",
        "generation._pad_token_id": "filled in by the controller",
        "generation._mtp_weights_from_refit": "filled in by the controller",
        "generation._debug_payload_metrics": "filled in by the controller",
        "generation.refit_cfg": (
            "NIXL / sparse refit transport (this worker refits over ZMQ or NCCL)"
        ),
        "generation.refit_transport": (
            "NIXL / sparse refit transport (this worker refits over ZMQ or NCCL)"
        ),
        "generation.real_quant_export_cpu_offload": _QUANT,
        "generation.real_quant": _QUANT,
        "generation.real_quant_ignore": _QUANT,
        "generation.quant_cfg": _QUANT,
        "generation.vllm_cfg": _ENGINE,
        "generation.vllm_kwargs": _ENGINE,
        "generation.sglang_cfg": _ENGINE,
        "generation.trtllm_cfg": _ENGINE,
        "generation.trtllm_kwargs": _ENGINE,
        "generation.dynamo_cfg": _ENGINE,
        "generation.mcore_generation_config": "Megatron inference settings",
        "generation.colocated.resources": "cluster placement (controller side)",
    }
)

logger = logging.getLogger("policyworker")


class ConfigWarning(UserWarning):
    """A config is valid but something in it is ignored or has no effect."""


class _InvalidValueError(ValueError):
    """A single value broke a rule; the message already says what, the value and the rule."""


class _RuleViolationsError(ConfigError):
    """Cross-field rules of one config class failed; `problems` holds (relative path, message)."""

    def __init__(self, problems: Sequence[tuple[str, str]], *, root: str) -> None:
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        lines = [f"{message} @ {_join_path(root, rel)}" for rel, message in self.problems]
        super().__init__("invalid policy config:\n  " + "\n  ".join(lines))


def _join_path(root: str, rel: str) -> str:
    return f"{root}.{rel}" if rel else root


def _raise_if_problems(problems: list[tuple[str, str]], *, root: str) -> None:
    if problems:
        raise _RuleViolationsError(problems, root=root)


@frozen
class _Rule:
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
            raise _InvalidValueError(f"{attribute.name} = {value!r} {self.rule}{fix}")


def _at_least(minimum: int) -> _Rule:
    return _Rule(lambda v: v >= minimum, f"must be >= {minimum}")


_POSITIVE = _Rule(lambda v: v > 0, "must be > 0")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_DOTTED_PATH = _Rule(
    lambda v: _DOTTED.fullmatch(v) is not None,
    "must be a dotted import path",
    "write it like torch.optim.AdamW",
)
_NON_EMPTY = _Rule(lambda v: len(v) > 0, "must not be empty")


def _valid_module_pattern(entry: str) -> bool:
    try:
        validate_target_entries([entry], what="entry")
    except ValueError:
        return False
    return True


_MODULE_PATTERNS = _Rule(
    lambda v: all(_valid_module_pattern(e) for e in v),
    "must hold module names, wildcards like '*_proj' or 're:<regex>' full-match patterns",
    "remove empty entries and fix the regular expression",
)


_LORA_COMPUTE_DTYPE = _Rule(
    lambda v: v in get_args(LoraComputeDtype),
    f"must be one of {', '.join(map(repr, get_args(LoraComputeDtype)))}",
    "use 'auto' (bfloat16 on CUDA when the base layers compute in bfloat16, else float32) or "
    "name a dtype, e.g. 'bfloat16'",
)


@frozen(kw_only=True)
class TokenizerConfig:
    """`policy.tokenizer`. `name` None means `model_name`; `chat_template` "default" keeps the
    tokenizer's own template, None is NeMo-RL's passthrough template, anything else is a
    `*.jinja` path or a literal template."""

    name: str | None = field(default=None, validator=_NON_EMPTY)
    chat_template: str | None = "default"
    chat_template_kwargs: dict[str, Any] | None = None
    use_processor: bool = False


@frozen(kw_only=True)
class LoRAConfig:
    """`policy.dtensor_cfg.lora_cfg` (present = enabled). Selection follows Automodel's
    ModuleMatcher: `match_all_linear` takes every linear layer but the output head; else
    `target_modules` if any; else every linear layer not in `exclude_modules`; with all three
    empty, `target_modules` is `["*_proj"]`. An entry matches a module whose dotted name equals
    it, ends with `.<entry>`, or matches it as an Automodel wildcard (`*` is any text, e.g.
    `*_proj`, `*.layers.0.*`); `re:<pattern>` is a full-match regex. `exclude_modules` also
    applies on top of the other two rules. `use_triton` is accepted for NeMo-RL compatibility;
    this worker has no Triton kernel. `compute_dtype` (not a NeMo-RL key) is the dtype of the
    adapter matmuls; the adapter parameters and the refit/export merge stay fp32 whatever it
    says. `auto` means bfloat16 on CUDA when the base layers compute in bfloat16 (bf16 weights or
    `precision: bfloat16` autocast over fp32 master weights), float32 otherwise. When it equals
    the autocast dtype and no dropout is active, each layer merges its adapter into the frozen
    weight in fp32 and casts it: one GEMM, with the weights the refit sends an engine in that
    dtype (bit for bit in eager layers; compiled layers sum the fp32 merge in another order), so
    the trainer scores tokens as the engine does on those weights. With input dropout the
    adapter shares the base layer's cast input and adds its output inside the up-projection's
    GEMM. (Automodel's `lora_dtype` is a different thing: the adapters' storage dtype.)"""

    target_modules: tuple[str, ...] = field(default=(), validator=_MODULE_PATTERNS)
    exclude_modules: tuple[str, ...] = field(default=(), validator=_MODULE_PATTERNS)
    match_all_linear: bool = False
    dim: int = field(default=8, validator=_at_least(1))
    alpha: float = field(default=32.0, validator=_POSITIVE)
    dropout: float = field(
        default=0.0, validator=_Rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")
    )
    dropout_position: DropoutPosition = "post"
    lora_A_init: LoraAInit = "xavier"  # noqa: N815 (NeMo-RL's key)
    use_rslora: bool = False
    use_triton: bool = False
    compute_dtype: LoraComputeDtype = field(default="auto", validator=_LORA_COMPUTE_DTYPE)


@frozen(kw_only=True)
class DTensorConfig:
    """`policy.dtensor_cfg`: parallel sizes, memory options, LoRA, the attention kernel and
    `fusion` (not a NeMo-RL key): `layer` runs each decoder layer through one `torch.compile`d
    graph, `norm_mlp` only RMSNorm and SiLU-gated MLP activations, `none` runs eager, `auto`
    (default) is `layer` on CUDA in a single process and `none` otherwise (CPU, or a process
    group, where FSDP2/TP own the layers). `layer` and `norm_mlp` need a single process and also
    fuse the next-token logprob kernels (one reduction and one pointwise kernel over the whole
    [T, V] logits instead of chunked eager fp32 passes: Triton kernels on CUDA, compiled by
    inductor elsewhere). A compile or start-up equality check that fails falls back to eager
    with one warning; the worker's `fusion_report` and start-up log line say what ran. Compiled
    graphs are cached on disk in `$TORCHINDUCTOR_CACHE_DIR` (default here:
    `$XDG_CACHE_HOME/policyworker/torchinductor`, i.e. `~/.cache/policyworker/torchinductor`), so
    the compile cost is paid once per machine.
    `moe_router_bias_update_rate` (NeMo-RL's `megatron_cfg` key): after each optimizer step every
    `e_score_correction_bias` (DeepSeek-V3-style routers) moves by this much toward balanced
    expert load; 0.0 (default) is off; models without such routers ignore it with one warning.
    `release_cache_after_train` (ours): NeMo-RL returns the CUDA caching allocator's free blocks
    to the driver at the end of every `train()`; that cost 71 ms of a 566 ms step on an H200
    (1.5B shape, packed; host profile of issue 17) and makes the next step allocate again.
    Off by default: `offload_before_refit`, the call a colocated loop makes next, releases them
    (as do the other offload calls); true restores NeMo-RL's behaviour, for a loop that hands
    the memory to an engine without an offload call."""

    tensor_parallel_size: int = field(default=1, validator=_at_least(1))
    context_parallel_size: int = field(default=1, validator=_at_least(1))
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    lora_cfg: LoRAConfig | None = None
    attn_implementation: AttnImplementation = "auto"
    fusion: FusionMode = "auto"
    moe_router_bias_update_rate: float = field(
        default=0.0, validator=_Rule(lambda v: v >= 0.0, "must be >= 0 (0 disables the update)")
    )
    release_cache_after_train: bool = False

    def __attrs_post_init__(self) -> None:
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            warnings.warn(
                "policy.dtensor_cfg.sequence_parallel is true but tensor_parallel_size is 1, so "
                "it has no effect; set sequence_parallel: false or tensor_parallel_size > 1",
                ConfigWarning,
                stacklevel=2,
            )


@frozen(kw_only=True)
class SequencePackingConfig:
    """`policy.sequence_packing` (present = enabled): bins of whole sequences per microbatch.
    `logprob_mb_tokens` None means the logprob paths use `train_mb_tokens`."""

    train_mb_tokens: int = field(validator=_at_least(1))
    logprob_mb_tokens: int | None = field(default=None, validator=_at_least(1))
    algorithm: PackingAlgorithm = "modified_first_fit_decreasing"
    microbatch_order: MicrobatchOrder = "packer"

    @property
    def logprob_tokens(self) -> int:
        """Token budget of a logprob microbatch."""
        return self.train_mb_tokens if self.logprob_mb_tokens is None else self.logprob_mb_tokens


@frozen(kw_only=True)
class DynamicBatchingConfig:
    """`policy.dynamic_batching` (present = enabled): microbatches by token budget.
    `logprob_mb_tokens` None means the logprob paths use `train_mb_tokens`."""

    train_mb_tokens: int = field(validator=_at_least(1))
    logprob_mb_tokens: int | None = field(default=None, validator=_at_least(1))
    sequence_length_round: int = field(default=64, validator=_at_least(1))

    @property
    def logprob_tokens(self) -> int:
        """Token budget of a logprob microbatch."""
        return self.train_mb_tokens if self.logprob_mb_tokens is None else self.logprob_mb_tokens


def _default_optimizer_kwargs() -> dict[str, Any]:
    return {"lr": 1e-5, "weight_decay": 0.01}


@frozen(kw_only=True)
class OptimizerConfig:
    """`policy.optimizer`: a dotted class path and its keyword arguments (string values starting
    with `torch.` are resolved to torch attributes by the shell)."""

    name: str = field(default="torch.optim.AdamW", validator=_DOTTED_PATH)
    kwargs: dict[str, Any] = field(factory=_default_optimizer_kwargs)


def _empty_kwargs() -> dict[str, Any]:
    # A typed factory: a bare `dict` factory would make the field dict[Unknown, Unknown].
    return {}


@frozen(kw_only=True)
class SchedulerEntry:
    """One learning-rate scheduler: a dotted class path and its keyword arguments."""

    name: str = field(validator=_DOTTED_PATH)
    kwargs: dict[str, Any] = field(factory=_empty_kwargs)


@frozen(kw_only=True)
class SchedulerConfig:
    """`policy.scheduler`. NeMo-RL writes one `{name, kwargs}` mapping, or a list of them plus one
    `{milestones: [...]}` item (a `SequentialLR`); both structure to this class and it
    unstructures back to NeMo-RL's form. `scheduler` absent means a constant learning rate."""

    entries: tuple[SchedulerEntry, ...]
    milestones: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        if not self.entries:
            problems.append(
                (
                    "",
                    "scheduler list has no {name, kwargs} entry; add one or omit "
                    "scheduler for a constant learning rate",
                )
            )
        elif len(self.milestones) != len(self.entries) - 1:
            problems.append(
                (
                    "",
                    f"{len(self.entries)} schedulers need "
                    f"{len(self.entries) - 1} milestones, got "
                    f"{list(self.milestones)}; add one {{milestones: [...]}} item "
                    "with a step count between each pair of schedulers",
                )
            )
        steps = (0, *self.milestones)
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            problems.append(
                (
                    "",
                    f"milestones {list(self.milestones)} must be strictly "
                    "increasing positive step counts",
                )
            )
        _raise_if_problems(problems, root="policy.scheduler")


@frozen(kw_only=True)
class ColocatedConfig:
    """`policy.generation.colocated`: whether inference shares this worker's accelerators."""

    enabled: bool = True


def _top_k_disabled_to_none(value: int | None) -> int | None:
    # vLLM spells "no top-k" as -1 (newer: 0); NeMo-RL as null. One spelling here: None.
    return None if value in (-1, 0) else value


@frozen(kw_only=True)
class GenerationConfig:
    """`policy.generation`: sampling parameters mirrored into training logprobs (None: SFT/DPO,
    no filtering, temperature 1). `top_k` -1 or 0 (vLLM's "disabled") structure to None."""

    temperature: float = field(default=1.0, validator=_POSITIVE)
    top_k: int | None = field(
        default=None, converter=_top_k_disabled_to_none, validator=_at_least(1)
    )
    top_p: float = field(
        default=1.0, validator=_Rule(lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
    )
    colocated: ColocatedConfig = ColocatedConfig()


@frozen(kw_only=True)
class RewardModelConfig:
    """`policy.reward_model_cfg` (present = enabled): the model is a reward model."""

    reward_model_type: RewardModelType = "bradley_terry"


@frozen(kw_only=True)
class RouterReplayConfig:
    """`policy.router_replay` (present = enabled): `get_logprobs` (unless
    `require_router_replay=False`) and `train` force the experts the rollout engine chose, data key
    `routed_experts` [B, S, layers, top_k] (layers: the MoE layers, or every decoder layer; a row
    of -1 keeps the model's own route). Qwen3-MoE, Mixtral and DeepSeek-V3; tp = cp = 1."""


@frozen(kw_only=True)
class DraftConfig:
    """`policy.draft` (present = enabled): an Eagle3-style draft trained beside the policy.

    The draft reads the policy's hidden states at `aux_layer_indices` (default: NeMo-RL's
    early/middle/late pick) and the next token's embedding, and learns the policy's next-token
    distribution; its loss is added with `loss_weight`. `model_name` is a folder holding a draft
    saved by this worker (config.json + safetensors); None builds a fresh draft of `num_layers`
    (default 1) layers shaped like the policy, its LM head copied from the policy's. Fixed,
    dynamic and packed batching (a packed row is split back into its documents for the draft).
    Data parallel (the draft is replicated, its gradients all-reduced over dp); tp = cp = 1."""

    model_name: str | None = field(default=None, validator=_NON_EMPTY)
    loss_weight: float = field(default=0.1, validator=_Rule(lambda v: v >= 0.0, "must be >= 0"))
    num_layers: int | None = field(default=None, validator=_at_least(1))
    aux_layer_indices: tuple[int, ...] | None = field(
        default=None,
        validator=_Rule(
            lambda v: len(v) > 0 and all(i >= 0 for i in v),
            "must list at least one layer index >= 0",
        ),
    )


@frozen(kw_only=True)
class PolicyConfig:
    """`policy`: everything one PolicyWorker reads. Build it with `load_config(mapping)`.

    Optional sections: absent, `null` and `{enabled: false, ...}` all mean disabled (None); see
    the module docstring. Use the `*_enabled` properties rather than testing sections.
    The microbatch-size rules apply to fixed microbatching only: under sequence packing or
    dynamic batching `train_micro_batch_size` is not used.
    """

    model_name: str = field(validator=_NON_EMPTY)
    tokenizer: TokenizerConfig = TokenizerConfig()
    precision: Precision = "bfloat16"
    train_global_batch_size: int = field(default=32, validator=_at_least(1))
    train_micro_batch_size: int = field(default=1, validator=_at_least(1))
    logprob_batch_size: int = field(default=8, validator=_at_least(1))
    logprob_chunk_size: int | None = field(default=None, validator=_at_least(1))
    max_grad_norm: float | None = field(default=1.0, validator=_POSITIVE)
    offload_optimizer_for_logprob: bool = False
    make_sequence_length_divisible_by: int = field(default=1, validator=_at_least(1))
    max_total_sequence_length: int | None = field(default=None, validator=_at_least(1))
    hf_config_overrides: dict[str, Any] = field(factory=_empty_kwargs)
    refit_buffer_size_gb: float | None = field(default=None, validator=_POSITIVE)
    batch_size: int | None = field(default=None, validator=_at_least(1))
    dtensor_cfg: DTensorConfig = DTensorConfig()
    sequence_packing: SequencePackingConfig | None = None
    dynamic_batching: DynamicBatchingConfig | None = None
    optimizer: OptimizerConfig | None = OptimizerConfig()
    scheduler: SchedulerConfig | None = None
    generation: GenerationConfig | None = None
    reward_model_cfg: RewardModelConfig | None = None
    router_replay: RouterReplayConfig | None = None
    draft: DraftConfig | None = None

    def __attrs_post_init__(self) -> None:
        _raise_if_problems(_cross_field_problems(self), root="policy")

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
        raise _RuleViolationsError(
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


# ---------------------------------------------------------------------------------------------
# The converter: strict scalars, literal sets, sections, scheduler forms, per-field validators.

converter: Final[cattrs.Converter] = cattrs.Converter(forbid_extra_keys=True)

_T = TypeVar("_T")
_SECTIONS: Final[tuple[type[Any], ...]] = (
    LoRAConfig,
    SequencePackingConfig,
    DynamicBatchingConfig,
    RewardModelConfig,
    RouterReplayConfig,
    DraftConfig,
)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _structure_int(value: Any, _: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _InvalidValueError(f"expected an integer, got {_describe(value)}")
    return value


def _structure_float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _InvalidValueError(f"expected a number, got {_describe(value)}")
    return float(value)


def _structure_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise _InvalidValueError(f"expected true or false, got {_describe(value)}")
    return value


def _structure_str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise _InvalidValueError(f"expected a string, got {_describe(value)}")
    return value


def _structure_any_dict(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _InvalidValueError(f"expected a mapping, got {_describe(value)}")
    items = cast(Mapping[Any, Any], value)
    bad = [key for key in items if not isinstance(key, str)]
    if bad:
        raise _InvalidValueError(f"mapping keys must be strings, got {bad!r}")
    return dict(items)


def _structure_dict_or_none_as_empty(value: Any, type_: Any) -> dict[str, Any]:
    return {} if value is None else _structure_any_dict(value, type_)


# Precision spellings that mean a canonical name (as `functional.dtypes.precision_dtype` reads
# them); the config stores the canonical one, so `precision: bf16` round-trips as "bfloat16".
PRECISION_ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
    }
)


def _structure_precision(value: Any, type_: Any) -> Any:
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        value = PRECISION_ALIASES.get(key, key)
    try:
        return _structure_literal(value, type_)
    except _InvalidValueError:
        raise _InvalidValueError(
            f"{value!r} is not a precision; use one of {', '.join(get_args(type_))} "
            f"(aliases: {', '.join(PRECISION_ALIASES)})"
        ) from None


def _structure_lora_compute_dtype(value: Any, type_: Any) -> Any:
    # the precision spellings (bf16, fp32, torch.float32, ...) are accepted here too
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        value = PRECISION_ALIASES.get(key, key)
    return value  # the field's validator names the value, the rule and the fix


def _is_literal(type_: Any) -> bool:
    return get_origin(type_) is Literal


def _structure_literal(value: Any, type_: Any) -> Any:
    choices = get_args(type_)
    if not isinstance(value, str) or value not in choices:
        raise _InvalidValueError(f"{value!r} is not one of {', '.join(repr(c) for c in choices)}")
    return value


def _is_homogeneous_tuple(type_: Any) -> bool:
    args = get_args(type_)
    return get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _structure_tuple(value: Any, type_: Any) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise _InvalidValueError(f"expected a list, got {_describe(value)}")
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
    if len(args) == 2 and args[1] is NoneType and args[0] in _SECTIONS:
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
            raise _InvalidValueError(f"expected a mapping or null, got {_describe(value)}")
        body = cast(Mapping[str, Any], value)
        enabled = body.get("enabled", True)
        if not isinstance(enabled, bool):
            raise _InvalidValueError(f"enabled must be true or false, got {_describe(enabled)}")
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
        raise _InvalidValueError(
            f"expected a {{name, kwargs}} mapping or a list of them plus one "
            f"{{milestones: [...]}}, got {_describe(value)}"
        )
    items = cast(Sequence[Any], value)
    entries: list[SchedulerEntry] = []
    milestones: list[tuple[int, ...]] = []
    errors: list[Exception] = []
    for index, item in enumerate(items):
        try:
            if isinstance(item, Mapping) and "milestones" in item:
                if milestones:
                    raise _InvalidValueError("a second {milestones: [...]} item; keep exactly one")
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
    return isinstance(type_, type) and attrs.has(type_) and type_.__module__ == __name__


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
# {}, and `scheduler` is a mapping or a list with a milestones item (see SchedulerConfig).
_FIELD_HOOKS: Final[dict[tuple[type[Any], str], Callable[[Any, Any], Any]]] = {
    (PolicyConfig, "hf_config_overrides"): _structure_dict_or_none_as_empty,
    (PolicyConfig, "precision"): _structure_precision,
    (LoRAConfig, "compute_dtype"): _structure_lora_compute_dtype,
    (PolicyConfig, "scheduler"): _structure_scheduler,
}


def _structure_attrs_factory(cls: Any) -> Callable[[Any, Any], Any]:
    overrides: dict[str, Any] = {}
    for attribute in attrs.fields(cls):
        hook = _FIELD_HOOKS.get((cls, attribute.name)) or converter.get_structure_hook(
            attribute.type
        )
        overrides[attribute.name] = override(struct_hook=_with_validator(hook, attribute))
    generated = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True, **overrides)

    def structure(value: Any, type_: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _InvalidValueError(f"expected a mapping, got {_describe(value)}")
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


# ---------------------------------------------------------------------------------------------
# Entry points.


def split_ignored_keys(mapping: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Return (a copy of `mapping` without the IGNORED_NEMO_RL_KEYS, their dotted paths found)."""
    return _split(mapping, "")


def _split(node: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    kept: dict[str, Any] = {}
    found: list[str] = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if path in IGNORED_NEMO_RL_KEYS:
            found.append(path)
        elif isinstance(value, Mapping) and any(
            k.startswith(f"{path}.") for k in IGNORED_NEMO_RL_KEYS
        ):
            child: Mapping[str, Any] = value  # pyright: ignore[reportUnknownVariableType]
            kept[key], below = _split(child, f"{path}.")
            found.extend(below)
        else:
            kept[key] = value
    return kept, tuple(found)


def load_config(mapping: Mapping[str, Any]) -> PolicyConfig:
    """Structure a plain mapping (e.g. NeMo-RL's `policy:` block) into a PolicyConfig.

    Raises:
        ConfigError: listing every problem, one per line, each ending `@ policy.<path>`.
    """
    if not isinstance(mapping, Mapping):  # pyright: ignore[reportUnnecessaryIsInstance]
        msg = f"a policy config must be a mapping, got {_describe(mapping)} @ policy"
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
        lines = _error_lines(exc, "policy", None)
        msg = f"invalid policy config ({len(lines)} problem{'s' * (len(lines) != 1)}):\n  "
        raise ConfigError(msg + "\n  ".join(lines)) from None


def config_to_dict(cfg: PolicyConfig) -> dict[str, Any]:
    """Plain JSON-able mapping (NeMo-RL key names) with `load_config(config_to_dict(c)) == c`."""
    result: dict[str, Any] = converter.unstructure(cfg)
    return result


def _error_lines(exc: BaseException, path: str, type_: Any) -> list[str]:
    if isinstance(exc, ClassValidationError | IterableValidationError):
        lines: list[str] = []
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                lines += _error_lines(sub, f"{path}.{note.name}", note.type)
            else:
                lines += _error_lines(sub, f"{path}[{note.index!r}]", note.type)
        for sub in without:
            lines += _error_lines(sub, path, None)
        return lines
    if isinstance(exc, _RuleViolationsError):
        return [f"{message} @ {_join_path(path, rel)}" for rel, message in exc.problems]
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
    if cls in _SECTIONS:
        names.append("enabled")
    return names


def _closest_key(key: str, known: list[str]) -> str | None:
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
        close = _closest_key(key, known)
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
        and (isinstance(exc, _InvalidValueError) or type_ is None)
    ):
        return exc.args[0]
    return cattrs.v.format_exception(exc, type_)

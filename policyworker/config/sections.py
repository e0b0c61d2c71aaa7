"""The sections of `policy`: one frozen attrs class per nested mapping (YAML keys are the
attribute names). `SECTIONS` lists the optional ones (absent, `null` or `enabled: false` mean
disabled)."""

import warnings
from typing import Any, Final

from attrs import field, frozen

from policyworker.config.rules import (
    ADAPTER_NAMES,
    DOTTED_PATH,
    LORA_COMPUTE_DTYPE,
    MODULE_PATTERNS,
    NON_EMPTY,
    POSITIVE,
    ConfigWarning,
    Rule,
    at_least,
    raise_if_problems,
)
from policyworker.config.values import (
    AttnImplementation,
    DataPlaneBackend,
    DataPlaneImpl,
    DropoutPosition,
    FetchPolicy,
    Float8Recipe,
    FusionMode,
    LoraAInit,
    LoraComputeDtype,
    LoraReference,
    MicrobatchOrder,
    PackingAlgorithm,
    RewardModelType,
)

__all__ = [
    "SECTIONS",
    "ColocatedConfig",
    "DataPlaneConfig",
    "DataPlaneObservabilityConfig",
    "DTensorConfig",
    "DraftConfig",
    "DynamicBatchingConfig",
    "Float8Config",
    "GenerationConfig",
    "LoRAConfig",
    "OptimizerConfig",
    "RewardModelConfig",
    "RouterReplayConfig",
    "SchedulerConfig",
    "SchedulerEntry",
    "SequencePackingConfig",
    "TokenizerConfig",
    "empty_kwargs",
]


@frozen(kw_only=True)
class TokenizerConfig:
    """`policy.tokenizer`. `name` None means `model_name`; `chat_template` "default" keeps the
    tokenizer's own template, None is NeMo-RL's passthrough template, anything else is a
    `*.jinja` path or a literal template."""

    name: str | None = field(default=None, validator=NON_EMPTY)
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
    GEMM. (Automodel's `lora_dtype` is a different thing: the adapters' storage dtype.)

    `adapters` (not a NeMo-RL key) names several adapters trained on one frozen base: each has
    its own weights, optimizer and scheduler state, and all share the settings above (and start
    from the same values). `train(..., adapter=name)`, `get_logprobs(..., adapter=name)` and
    `select_adapter(name)` make one the model's adapter; calls without a name, refits and
    `save_checkpoint` use that one (the first name until another is picked). Empty (the
    default) is one unnamed adapter. `reference` (not a NeMo-RL key) is the reference policy:
    `initial` a CPU copy of the weights at construction, `base` the base model with every
    adapter switched off (no copy)."""

    target_modules: tuple[str, ...] = field(default=(), validator=MODULE_PATTERNS)
    exclude_modules: tuple[str, ...] = field(default=(), validator=MODULE_PATTERNS)
    match_all_linear: bool = False
    dim: int = field(default=8, validator=at_least(1))
    alpha: float = field(default=32.0, validator=POSITIVE)
    dropout: float = field(
        default=0.0, validator=Rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")
    )
    dropout_position: DropoutPosition = "post"
    lora_A_init: LoraAInit = "xavier"  # noqa: N815 (NeMo-RL's key)
    use_rslora: bool = False
    use_triton: bool = False
    compute_dtype: LoraComputeDtype = field(default="auto", validator=LORA_COMPUTE_DTYPE)
    adapters: tuple[str, ...] = field(default=(), validator=ADAPTER_NAMES)
    reference: LoraReference = "initial"


@frozen(kw_only=True)
class Float8Config:
    """`policy.dtensor_cfg.fp8` (present = enabled; not a NeMo-RL key): the decoder layers'
    linear matmuls run in float8 through torchao's float8 training (`pip install
    'policyworker[fp8]'`), composed with `fusion: layer`. `recipe` is torchao's: `tensorwise`
    (default; per-tensor scales, the fastest) or `rowwise` / `rowwise_with_gw_hp`. The output
    head, the embeddings and any linear whose dims are not multiples of 16 keep their precision;
    under LoRA the frozen base GEMM of each adapted layer runs in float8 and the adapter stays in
    its compute dtype (the adapter is then not merged into the GEMM). Master weights, optimizer
    state, checkpoints and the refit keep their names and dtypes. Where float8 cannot run (no
    CUDA, compute capability below 8.9, torchao missing or too old, tensor parallelism) the worker
    trains as without this section, after one warning per process; `PolicyWorker.float8_report`
    says what ran."""

    recipe: Float8Recipe = "tensorwise"


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
    (1.5B shape, packed; a host profile) and makes the next step allocate again.
    Off by default: `offload_before_refit`, the call a colocated loop makes next, releases them
    (as do the other offload calls); true restores NeMo-RL's behaviour, for a loop that hands
    the memory to an engine without an offload call.
    `memory_budget_gb` (ours): the device bytes one worker may use; the memory planner
    (`PolicyWorker.plan_memory`, docs/memory.md) refuses at construction a config whose predicted
    peak exceeds it, naming the phase and the knob. None: the GPU's total memory on CUDA, no
    check on the CPU. `auto_tune` (ours): set the sequence-packing / dynamic-batching
    `train_mb_tokens` and `logprob_mb_tokens` and `logprob_chunk_size` to the largest values the
    planner predicts to fit that budget (needs a budget: CUDA or `memory_budget_gb`). `fp8`
    (ours): float8 matmuls in the decoder layers (`Float8Config`; absent: off)."""

    tensor_parallel_size: int = field(default=1, validator=at_least(1))
    context_parallel_size: int = field(default=1, validator=at_least(1))
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    lora_cfg: LoRAConfig | None = None
    attn_implementation: AttnImplementation = "auto"
    fusion: FusionMode = "auto"
    moe_router_bias_update_rate: float = field(
        default=0.0, validator=Rule(lambda v: v >= 0.0, "must be >= 0 (0 disables the update)")
    )
    release_cache_after_train: bool = False
    memory_budget_gb: float | None = field(default=None, validator=POSITIVE)
    auto_tune: bool = False
    fp8: Float8Config | None = None

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

    train_mb_tokens: int = field(validator=at_least(1))
    logprob_mb_tokens: int | None = field(default=None, validator=at_least(1))
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

    train_mb_tokens: int = field(validator=at_least(1))
    logprob_mb_tokens: int | None = field(default=None, validator=at_least(1))
    sequence_length_round: int = field(default=64, validator=at_least(1))

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

    name: str = field(default="torch.optim.AdamW", validator=DOTTED_PATH)
    kwargs: dict[str, Any] = field(factory=_default_optimizer_kwargs)


def empty_kwargs() -> dict[str, Any]:
    # A typed factory: a bare `dict` factory would make the field dict[Unknown, Unknown].
    return {}


@frozen(kw_only=True)
class SchedulerEntry:
    """One learning-rate scheduler: a dotted class path and its keyword arguments."""

    name: str = field(validator=DOTTED_PATH)
    kwargs: dict[str, Any] = field(factory=empty_kwargs)


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
        raise_if_problems(problems, root="policy.scheduler")


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

    temperature: float = field(default=1.0, validator=POSITIVE)
    top_k: int | None = field(
        default=None, converter=_top_k_disabled_to_none, validator=at_least(1)
    )
    top_p: float = field(default=1.0, validator=Rule(lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"))
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

    model_name: str | None = field(default=None, validator=NON_EMPTY)
    loss_weight: float = field(default=0.1, validator=Rule(lambda v: v >= 0.0, "must be >= 0"))
    num_layers: int | None = field(default=None, validator=at_least(1))
    aux_layer_indices: tuple[int, ...] | None = field(
        default=None,
        validator=Rule(
            lambda v: len(v) > 0 and all(i >= 0 for i in v),
            "must list at least one layer index >= 0",
        ),
    )


@frozen(kw_only=True)
class DataPlaneObservabilityConfig:
    """`policy.data_plane.observability`: per-operation records of the data-plane client."""

    enabled: bool = False


@frozen(kw_only=True)
class DataPlaneConfig:
    """`policy.data_plane` (present = enabled): presharded calls fetch their rows by key.

    NeMo-RL's keys: `impl` picks the adapter (`transfer_queue`, the TransferQueue package on a
    Ray cluster; `in_process`, a dictionary in this process, for tests without Ray); `backend`,
    `storage_capacity` and `num_storage_units` size TransferQueue's storage (`simple` is its
    SimpleStorage); `global_segment_size` / `local_buffer_size` are read by `mooncake_cpu` only;
    `claim_meta_poll_interval_s` and `ack_timeout_ms` bound the waits. `fetch_policy` says who
    fetches inside a replica group (the tp x cp ranks of one dp rank): `independent` every rank,
    `leader_broadcast` the group's first rank, which broadcasts the tensors, `auto` the leader
    when the group has more than one rank."""

    impl: DataPlaneImpl = "transfer_queue"
    backend: DataPlaneBackend = "simple"
    storage_capacity: int | None = field(default=None, validator=at_least(1))
    num_storage_units: int = field(default=1, validator=at_least(1))
    claim_meta_poll_interval_s: float = field(default=0.05, validator=POSITIVE)
    global_segment_size: int = field(default=4 << 30, validator=at_least(1))
    local_buffer_size: int = field(default=1 << 30, validator=at_least(1))
    controller_address: str | None = field(default=None, validator=NON_EMPTY)
    ack_timeout_ms: int = field(default=60_000, validator=at_least(1))
    fetch_policy: FetchPolicy = "auto"
    observability: DataPlaneObservabilityConfig = DataPlaneObservabilityConfig()


SECTIONS: Final[tuple[type[Any], ...]] = (
    LoRAConfig,
    Float8Config,
    SequencePackingConfig,
    DynamicBatchingConfig,
    RewardModelConfig,
    RouterReplayConfig,
    DraftConfig,
    DataPlaneConfig,
)

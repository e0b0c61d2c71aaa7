"""The memory planner's shell: the shape numbers from an HF config or a built model, the knobs
from a `PolicyConfig`, the device budget, and the pre-flight check and auto-tune a
`PolicyWorker` runs before it allocates anything. The arithmetic is `functional.memory_plan`.

Pre-flight runs only where a budget is known: `dtensor_cfg.memory_budget_gb`, or the GPU's total
memory on CUDA less a 2 GiB reserve. The CPU is never refused by default (its RAM is shared with
everything else). With the card's budget and fixed microbatches only the data-independent terms
are checked (a padded microbatch is as wide as its batch's longest row, not
`max_total_sequence_length`); an explicit budget checks every term at the configured maximum.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.distributed as dist

from policyworker.config import PolicyConfig
from policyworker.errors import ConfigError
from policyworker.functional.dtypes import precision_dtype
from policyworker.functional.logprob_kernels import EAGER_KERNELS
from policyworker.functional.memory_plan import (
    MemoryKnobs,
    MemoryPlan,
    ModelShape,
    largest_fitting,
    plan_memory,
    with_knob,
)
from policyworker.functional.optimizer_memory import (
    OptimizerMemory,
    factored_state_elements,
    optimizer_memory,
)
from policyworker.shell.kernels.fusion import resolve_fusion_mode
from policyworker.shell.model import sources
from policyworker.shell.worker.state import WorkerState

__all__ = [
    "budget_bytes",
    "knobs_from_config",
    "plan_for_state",
    "plan_table",
    "preflight",
    "shape_from_hf_config",
    "shape_from_model",
]

_GIB = 2**30
# Where the planner does not count: the CUDA context, cuBLAS/attention workspaces and the
# caching allocator's fragmentation. A budget taken from the card keeps this much back.
_CUDA_RESERVE_BYTES = 2 * _GIB
_AUTO_TUNE_MAX_TOKENS = 1 << 20
_AUTO_TUNE_MULTIPLE = 256
# Past this many positions a bigger LM-head chunk no longer speeds the head GEMM up.
_AUTO_TUNE_MAX_CHUNK = 8192
_CPU_REFIT_BUCKET_BYTES = 64 << 20
_CUDA_REFIT_BUCKET_CAP_BYTES = 1 << 30
_CUDA_REFIT_BUCKET_FRACTION = 0.02
# Which knob to change when a phase does not fit.
_KNOB_FOR_PHASE = {
    "train_step": "sequence_packing/dynamic_batching.train_mb_tokens (or train_micro_batch_size),"
    " or dtensor_cfg.activation_checkpointing: true",
    "optimizer_step": "the optimizer (torch.optim.Adafactor keeps a factored state, SGD none; "
    "see docs/memory.md), LoRA "
    "(dtensor_cfg.lora_cfg), or more data-parallel ranks",
    "logprobs": "logprob_mb_tokens (or logprob_batch_size) and logprob_chunk_size, or "
    "offload_optimizer_for_logprob: true",
    "reference": "logprob_mb_tokens (or logprob_batch_size) and logprob_chunk_size",
    "topk": "logprob_mb_tokens (or logprob_batch_size) and the top-k k",
    "refit": "refit_buffer_size_gb",
    "checkpoint": "more data-parallel ranks (the weights and optimizer state alone do not fit)",
}


def _text_config(hf_config: Any) -> Any:
    getter = getattr(hf_config, "get_text_config", None)
    return getter() if callable(getter) else hf_config


def _decoder_param_shapes(c: Any, lora_rank: int | None) -> tuple[list[tuple[int, ...]], int]:
    """(the trainable parameters' shapes, the parameter count) of a Llama/Qwen/Mistral-style
    decoder config `c`; with LoRA of rank `lora_rank` on every projection, only its adapters
    (``A: [r, in]``, ``B: [out, r]``) are trainable."""
    h, layers, vocab = int(c.hidden_size), int(c.num_hidden_layers), int(c.vocab_size)
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or h // heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads) * head_dim
    inter = int(getattr(c, "intermediate_size", None) or 4 * h)
    q = heads * head_dim
    # (out, in) of q, k, v, o, gate, up, down
    linears = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
    vectors = [(h,), (h,)]  # the two RMSNorms
    if getattr(c, "attention_bias", c.model_type == "qwen2"):
        vectors += [(q,), (kv,), (kv,)]
    if c.model_type.startswith("qwen3"):  # per-head q and k RMSNorms
        vectors += [(head_dim,), (head_dim,)]
    tied = bool(getattr(c, "tie_word_embeddings", False))
    outer = [(vocab, h)] * (1 if tied else 2) + [(h,)]
    full = outer + layers * (linears + vectors)
    num_params = sum(math.prod(s) for s in full)
    if lora_rank is None:
        return full, num_params
    adapters = [s for out, fan_in in linears for s in ((lora_rank, fan_in), (out, lora_rank))]
    return layers * adapters, num_params


def shape_from_hf_config(hf_config: Any, *, lora_rank: int | None = None) -> ModelShape:
    """The shape of a Llama/Qwen/Mistral-style decoder from its HF config (parameter shapes by
    formula; with LoRA of rank `lora_rank` on every projection, its adapters are trainable)."""
    c = _text_config(hf_config)
    h, vocab = int(c.hidden_size), int(c.vocab_size)
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or h // heads)
    trainable, num_params = _decoder_param_shapes(c, lora_rank)
    return ModelShape(
        num_params=num_params,
        num_trainable=sum(math.prod(s) for s in trainable),
        num_layers=int(c.num_hidden_layers),
        hidden=h,
        intermediate=int(getattr(c, "intermediate_size", None) or 4 * h),
        vocab=vocab,
        kv_dim=int(getattr(c, "num_key_value_heads", None) or heads) * head_dim,
        largest_tensor=vocab * h,
        factored_state_elements=factored_state_elements(trainable),
    )


def shape_from_model(model: torch.nn.Module) -> ModelShape:
    """The shape of a built model: its real parameter counts (global, not this rank's shard)."""
    params = list(model.parameters())
    config = getattr(model, "config", None)
    base = shape_from_hf_config(config) if config is not None else None
    return ModelShape(
        num_params=sum(p.numel() for p in params),
        num_trainable=sum(p.numel() for p in params if p.requires_grad),
        num_layers=base.num_layers if base else 0,
        hidden=base.hidden if base else 0,
        intermediate=base.intermediate if base else 0,
        vocab=base.vocab if base else 0,
        kv_dim=base.kv_dim if base else 0,
        largest_tensor=max((p.numel() for p in params), default=0),
        factored_state_elements=factored_state_elements(
            tuple(p.shape) for p in params if p.requires_grad
        ),
    )


def _batching(cfg: PolicyConfig) -> Any:
    return cfg.sequence_packing or cfg.dynamic_batching


def _train_tokens(cfg: PolicyConfig) -> int:
    batching = _batching(cfg)
    if batching is not None:
        return int(batching.train_mb_tokens)
    return cfg.train_micro_batch_size * (cfg.max_total_sequence_length or 0)


def _logprob_tokens(cfg: PolicyConfig) -> int:
    batching = _batching(cfg)
    if batching is not None:
        return int(batching.logprob_mb_tokens or batching.train_mb_tokens)
    return cfg.logprob_batch_size * (cfg.max_total_sequence_length or 0)


def _one_microbatch_per_step(cfg: PolicyConfig) -> bool:
    """Whether every train step is one microbatch on each rank, so no gradients are live during
    its forward (counted as if a single rank held the whole global batch: never too few)."""
    batching = _batching(cfg)
    if batching is None:
        return cfg.train_global_batch_size <= cfg.train_micro_batch_size
    rows_tokens = cfg.train_global_batch_size * (cfg.max_total_sequence_length or 0)
    return 0 < rows_tokens <= int(batching.train_mb_tokens)


def knobs_from_config(
    cfg: PolicyConfig,
    *,
    device: torch.device,
    fused_logprobs: bool,
    shards: int = 1,
    compiled_layers: bool = False,
) -> MemoryKnobs:
    """The planner's knobs of `cfg` on `device` (master weights fp32 as the worker keeps them);
    `compiled_layers`: the decoder layers run compiled whole (`fusion: layer`)."""
    compute = precision_dtype(cfg.precision).itemsize
    if cfg.optimizer is None:
        optimizer = OptimizerMemory(dense_states=0)
    else:
        optimizer = optimizer_memory(cfg.optimizer.name, cfg.optimizer.kwargs or {})
    if cfg.refit_buffer_size_gb is not None:
        bucket = int(cfg.refit_buffer_size_gb * _GIB)
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        bucket = min(int(total * _CUDA_REFIT_BUCKET_FRACTION), _CUDA_REFIT_BUCKET_CAP_BYTES)
    else:
        bucket = _CPU_REFIT_BUCKET_BYTES
    return MemoryKnobs(
        train_mb_tokens=_train_tokens(cfg),
        logprob_mb_tokens=_logprob_tokens(cfg),
        logprob_chunk_tokens=cfg.logprob_chunk_size or 0,
        train_logprob_chunk=cfg.logprob_chunk_size or 0,
        activation_checkpointing=cfg.dtensor_cfg.activation_checkpointing,
        fused_logprobs=fused_logprobs,
        compiled_layers=compiled_layers,
        grads_in_forward=not _one_microbatch_per_step(cfg),
        master_bytes=4,
        compute_bytes=compute,
        export_bytes=compute if compute < 4 else 4,
        optimizer_states=optimizer.dense_states,
        factored_optimizer_state=optimizer.factored,
        per_tensor_update=optimizer.per_tensor_update,
        optimizer_on_device_for_logprobs=not cfg.offload_optimizer_for_logprob,
        shards=shards,
        refit_bucket_bytes=bucket,
    )


def budget_bytes(cfg: PolicyConfig, device: torch.device) -> int | None:
    """The bytes one worker may use: `memory_budget_gb`, else the card's total memory less a
    reserve on CUDA, else None (no check on the CPU)."""
    if cfg.dtensor_cfg.memory_budget_gb is not None:
        return int(cfg.dtensor_cfg.memory_budget_gb * _GIB)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1]) - _CUDA_RESERVE_BYTES
    return None


def plan_table(plan: MemoryPlan, budget: int | None) -> dict[str, dict[str, Any]]:
    """The plan as plain values: per phase its terms, total bytes and whether it fits."""
    return {
        p.phase: {
            "terms": dict(p.terms),
            "total_bytes": p.total,
            "budget_bytes": budget,
            "fits": None if budget is None else p.total <= budget,
        }
        for p in plan.phases
    }


def check_fits(plan: MemoryPlan, budget: int) -> None:
    """ConfigError naming the first phase over `budget`, both byte counts and the knob."""
    for p in plan.phases:
        if p.total > budget:
            terms = ", ".join(f"{k} {v / _GIB:.2f} GiB" for k, v in p.terms if v)
            msg = (
                f"policy: the {p.phase} phase is predicted to need {p.total} bytes "
                f"({p.total / _GIB:.2f} GiB: {terms}) but {budget} bytes "
                f"({budget / _GIB:.2f} GiB) are available (dtensor_cfg.memory_budget_gb or the "
                f"GPU's memory); lower {_KNOB_FOR_PHASE[p.phase]}, or set "
                f"dtensor_cfg.auto_tune: true (see docs/memory.md)"
            )
            raise ConfigError(msg)


def _phase_total(shape: ModelShape, knobs: MemoryKnobs, knob: str, *phases: str) -> Any:
    """x -> the largest total of `phases` with the integer knob `knob` set to x (bisection)."""

    def total(x: int) -> int:
        tried = with_knob(knobs, knob, x)
        if knob == "logprob_chunk_tokens":  # logprob_chunk_size sizes both chunks
            tried = with_knob(tried, "train_logprob_chunk", x)
        plan = plan_memory(shape, tried)
        return max(plan.phase(p).total for p in phases)

    return total


def _tuned(cfg: PolicyConfig, shape: ModelShape, knobs: MemoryKnobs, budget: int) -> PolicyConfig:
    """`cfg` with the microbatch tokens and logprob chunk the planner predicts to fit; with fixed
    microbatching only the chunk (the batch sizes are the batch math's, not a memory knob).
    Gradients count as live in every forward: a larger microbatch can make a step one
    microbatch and drop them, which would make the totals fall as the tokens grow (no longer a
    bisection) and leaves no room for a step that gets two microbatches after all."""
    batching = _batching(cfg)
    knobs = attrs.evolve(knobs, grads_in_forward=True)
    changes: dict[str, int] = {}
    knob_phases = (("train_mb_tokens", "train_step"), ("logprob_mb_tokens", "logprobs"))
    for knob, phase in knob_phases if batching is not None else ():
        best = largest_fitting(
            _phase_total(shape, knobs, knob, phase),
            budget=budget,
            low=cfg.max_total_sequence_length or _AUTO_TUNE_MULTIPLE,
            high=_AUTO_TUNE_MAX_TOKENS,
            multiple=_AUTO_TUNE_MULTIPLE,
        )
        if best is not None:
            changes[knob] = best
            knobs = with_knob(knobs, knob, best)
    # The chunk also sizes the eager training logprobs' scratch: it must fit both phases.
    chunk = largest_fitting(
        _phase_total(shape, knobs, "logprob_chunk_tokens", "logprobs", "train_step"),
        budget=budget,
        low=1,
        high=max(min(knobs.logprob_mb_tokens, _AUTO_TUNE_MAX_CHUNK), 1),
    )
    if batching is not None and changes:
        section = "sequence_packing" if cfg.sequence_packing is not None else "dynamic_batching"
        cfg = attrs.evolve(cfg, **{section: attrs.evolve(batching, **changes)})
    if chunk is not None and cfg.logprob_chunk_size is None:
        cfg = attrs.evolve(cfg, logprob_chunk_size=chunk)
    return cfg


def _hf_config(cfg: PolicyConfig) -> Any | None:
    """The HF config of `model_name`, or None where it cannot be read (the build names why)."""
    import transformers

    try:
        offline = sources.hub_local_files_only(cfg.model_name, "model_name")
        return transformers.AutoConfig.from_pretrained(
            cfg.model_name, local_files_only=offline, **dict(cfg.hf_config_overrides)
        )
    except (OSError, ValueError):
        return None


def preflight(cfg: PolicyConfig) -> PolicyConfig:
    """Auto-tune (where asked) and check `cfg` against the budget before anything is built;
    `cfg` unchanged when no budget is known or the model's config cannot be read yet.

    Raises:
        ConfigError: a phase is predicted over the budget, or auto_tune has no budget.
    """
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    budget = budget_bytes(cfg, device)
    if budget is None:
        if cfg.dtensor_cfg.auto_tune:
            msg = (
                "policy.dtensor_cfg.auto_tune: true needs a memory budget, and on the CPU there "
                "is none by default; set policy.dtensor_cfg.memory_budget_gb"
            )
            raise ConfigError(msg)
        return cfg
    hf_config = _hf_config(cfg)
    if hf_config is None:
        return cfg
    lora = cfg.dtensor_cfg.lora_cfg
    shape = shape_from_hf_config(hf_config, lora_rank=None if lora is None else lora.dim)
    fused = device.type == "cuda" and cfg.dtensor_cfg.fusion in ("auto", "layer", "norm_mlp")
    # FSDP shards weights, gradients and state over every rank of the process group.
    shards = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    compiled = resolve_fusion_mode(cfg.dtensor_cfg.fusion, device=device, distributed=shards > 1)
    flags = {"fused_logprobs": fused, "shards": shards, "compiled_layers": compiled == "layer"}
    knobs = knobs_from_config(cfg, device=device, **flags)
    if cfg.dtensor_cfg.auto_tune:
        cfg = _tuned(cfg, shape, knobs, budget)
        knobs = knobs_from_config(cfg, device=device, **flags)
    if cfg.dtensor_cfg.memory_budget_gb is None and _batching(cfg) is None:
        # The card's own budget with fixed microbatches: their width is the batch's longest
        # row, usually far below max_total_sequence_length, so only what the data cannot
        # shrink (weights, gradients, optimizer state) is refused by default.
        knobs = attrs.evolve(knobs, train_mb_tokens=0, logprob_mb_tokens=0)
    check_fits(plan_memory(shape, knobs), budget)
    return cfg


def plan_for_state(state: WorkerState) -> dict[str, dict[str, Any]]:
    """The memory plan of a built worker (its real parameter counts and logprob kernels)."""
    knobs = knobs_from_config(
        state.cfg,
        device=state.device,
        fused_logprobs=state.logprob_kernels is not EAGER_KERNELS,
        shards=state.parallel.world_size,
        compiled_layers=state.fusion_report.fused_layers > 0,
    )
    plan = plan_memory(shape_from_model(state.model), knobs)
    return plan_table(plan, budget_bytes(state.cfg, state.device))

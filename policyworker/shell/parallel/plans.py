"""Apply tensor parallelism and FSDP2 to a Hugging Face causal LM (the
layout NeMo-RL's DTensor worker uses: column/row-parallel projections, vocab-parallel lm_head).

Order (torchtitan's): tensor parallel on `ctx.mesh["tp"]` first, then FSDP2 `fully_shard` per
decoder layer and on the root over the dp mesh (dp x cp flattened when cp > 1). Under TP the
lm_head is vocab-parallel: logits leave the model as a DTensor sharded on the vocab dim, which
`shell.parallel.collectives.next_token_logprobs_any` consumes without gathering the vocab.

Plan FQNs are relative to the `*ForCausalLM` module; a `*` matches one name component
(`model.layers.*.mlp.up_proj`), as in `torch.distributed.tensor.parallel.parallelize_module`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from policyworker.shell.parallel.context import ParallelContext

__all__ = [
    "TP_STYLE_NAMES",
    "SUPPORTED_TP_MODEL_TYPES",
    "parallelize_model",
    "tensor_parallel_plan",
    "check_tp_divisibility",
    "apply_activation_checkpointing",
    "move_buffers",
    "reshard",
    "decoder_layers",
]

SUPPORTED_TP_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def _style_factories() -> dict[str, Callable[[], ParallelStyle]]:
    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "vocab_parallel_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
        "vocab_parallel_lm_head": lambda: ColwiseParallel(
            output_layouts=Shard(-1), use_local_output=False
        ),
        "sequence_parallel": lambda: SequenceParallel(),
    }


TP_STYLE_NAMES = tuple(_style_factories())


def tensor_parallel_plan(
    model_type: str, *, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The built-in TP plan for Llama / Qwen2 / Qwen3 (q/k/v/gate/up colwise, o/down rowwise).

    Raises:
        ValueError: `model_type` has no built-in plan.
    """
    if model_type not in SUPPORTED_TP_MODEL_TYPES:
        msg = (
            f"model_type {model_type!r} has no built-in tensor-parallel plan (built in: "
            f"{', '.join(SUPPORTED_TP_MODEL_TYPES)}); pass custom_plan={{module pattern: style}} "
            f"with styles from {TP_STYLE_NAMES}"
        )
        raise ValueError(msg)
    layer = "model.layers.*"
    plan: dict[str, ParallelStyle] = {
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
    }
    if model_type == "qwen3":
        # q_norm/k_norm act per head on head-sharded q/k: gather the heads around them so their
        # (replicated) weights see every head and get the full gradient on every TP rank.
        heads = Shard(2)  # [B, S, heads, head_dim]
        for name in ("q_norm", "k_norm"):
            plan[f"{layer}.self_attn.{name}"] = PrepareModuleInputOutput(
                input_layouts=(heads,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(heads,),
            )
    if not sequence_parallel:
        plan |= {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            f"{layer}.self_attn.o_proj": RowwiseParallel(),
            f"{layer}.mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        return plan
    # Sequence parallel: the residual stream stays a DTensor sharded on the sequence dim; norms
    # run on their sequence shard; attention and MLP inputs are all-gathered on entry.
    seq = Shard(1)
    return plan | {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=False
        ),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        "model.norm": SequenceParallel(),
        f"{layer}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        f"{layer}.mlp": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        ),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "lm_head": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }


def _plan_from_config(custom_plan: Mapping[str, object]) -> dict[str, ParallelStyle]:
    factories = _style_factories()
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in custom_plan.items():
        if isinstance(style, ParallelStyle):
            plan[pattern] = style
        elif isinstance(style, str) and style in factories:
            plan[pattern] = factories[style]()
        else:
            msg = (
                f"custom_plan[{pattern!r}] = {style!r} is not a tensor-parallel style; use one of "
                f"{TP_STYLE_NAMES} or a torch ParallelStyle"
            )
            raise ValueError(msg)
    return plan


def check_tp_divisibility(config: object, tp_size: int) -> None:
    """Raise ValueError naming the first model-config value that `tp_size` does not divide."""
    checks = (
        ("num_attention_heads", "attention heads are split across tensor-parallel ranks"),
        ("num_key_value_heads", "key/value heads are split across tensor-parallel ranks"),
        ("vocab_size", "the embedding and lm_head are split on the vocab"),
        ("intermediate_size", "the MLP is split on its hidden size"),
    )
    for key, why in checks:
        value = getattr(config, key, None)
        if value is not None and value % tp_size != 0:
            divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            msg = (
                f"model config {key}={value} is not divisible by tensor_parallel_size={tp_size} "
                f"({why}); choose a tensor_parallel_size that divides {value}, e.g. one of "
                f"{divisors[-4:]}"
            )
            raise ValueError(msg)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (modules whose class is in the model's `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        msg = (
            f"found no decoder layers in {type(model).__name__}: its _no_split_modules "
            f"{sorted(names)} match no submodule; FSDP2 needs one unit per layer"
        )
        raise ValueError(msg)
    return layers


def apply_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in backward (non-reentrant; parameter names unchanged)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _tie_lm_head(model: Any) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.get_input_embeddings().weight


def _apply_tp(
    model: Any,
    ctx: ParallelContext,
    *,
    sequence_parallel: bool,
    custom_plan: Mapping[str, object] | None,
) -> None:
    config = model.config
    if custom_plan is not None:
        plan = _plan_from_config(custom_plan)
    else:
        check_tp_divisibility(config, ctx.tp_size)
        plan = tensor_parallel_plan(config.model_type, sequence_parallel=sequence_parallel)
    if _lora_modules(model):  # adapters follow their base layer's sharding (shell/model/lora.py)
        from policyworker.shell.model.lora_tp import lora_tp_plan

        plan = lora_tp_plan(plan)
    if ctx.mesh is None:
        msg = "tensor parallelism needs a process group; this ParallelContext has no mesh"
        raise ValueError(msg)
    parallelize_module(model, ctx.mesh["tp"], plan)
    _tie_lm_head(model)


def _lora_modules(model: nn.Module) -> list[nn.Module]:
    from policyworker.shell.model.lora import lora_modules

    return list(lora_modules(model).values())


def parallelize_model(
    model: Any,
    ctx: ParallelContext,
    *,
    precision: torch.dtype,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    sequence_parallel: bool = False,
    custom_plan: Mapping[str, object] | None = None,
) -> nn.Module:
    """Apply TP (tp > 1), then FSDP2 per decoder layer + root; returns the same module.

    LoRA layers (`shell.lora.LinearLoRA`, injected before this call) get `lora_tp_plan` under
    TP, and under a low-precision policy their own fp32 FSDP2 unit.

    A single process (no process group, `ctx.mesh is None`) gets only activation checkpointing.
    With a process group, FSDP2 is applied even at world size 1 (that is how one GPU gets CPU
    offload and FSDP2 mixed precision). `precision` float32 means no mixed-precision policy;
    otherwise parameters are cast to `precision` for compute and gradients reduced in fp32.

    Raises:
        ValueError: a model dimension is not divisible by tp_size, the model type has no
            built-in TP plan (and no `custom_plan`), or sequence_parallel without TP.
    """
    if sequence_parallel and ctx.tp_size == 1:
        msg = (
            "sequence_parallel=True needs tensor_parallel_size > 1; set sequence_parallel to false"
        )
        raise ValueError(msg)
    if ctx.tp_size > 1:
        # Validate before touching the model so a bad config leaves it unchanged.
        if custom_plan is None:
            tensor_parallel_plan(model.config.model_type)
            check_tp_divisibility(model.config, ctx.tp_size)
        else:
            _plan_from_config(custom_plan)
    layers = decoder_layers(model) if ctx.mesh is not None else []
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if ctx.mesh is None:
        return model
    if ctx.tp_size > 1:
        _apply_tp(model, ctx, sequence_parallel=sequence_parallel, custom_plan=custom_plan)
    mp_policy = (
        MixedPrecisionPolicy()
        if precision == torch.float32
        else MixedPrecisionPolicy(param_dtype=precision, reduce_dtype=torch.float32)
    )
    fsdp_mesh = ctx.fsdp_mesh()
    fsdp_kwargs: dict[str, Any] = {"mesh": fsdp_mesh, "mp_policy": mp_policy}
    if cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if precision != torch.float32:
        # LoRA layers are their own FSDP2 units without a param cast, so the fp32 adapters are
        # gathered and used in fp32 (the frozen base weight is cast by autocast in forward).
        lora_kwargs: dict[str, Any] = {
            **fsdp_kwargs,
            "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32),
        }
        for lora_layer in _lora_modules(model):
            fully_shard(lora_layer, **lora_kwargs)
    for layer in layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def reshard(model: nn.Module) -> None:
    """Return FSDP2 parameters to their sharded form (no-op without FSDP2).

    After a forward with no backward (logprob inference) the root's parameters stay unsharded,
    and `model.parameters()` / `state_dict()` then yield the unsharded plain tensors: an
    optimizer built, or a state dict read, at that moment would miss the sharded DTensors.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def move_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Move every buffer to `device` (FSDP2's `.to()` moves parameters, not buffers)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != torch.device(device):
                module._buffers[name] = buffer.to(device)

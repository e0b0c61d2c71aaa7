"""NeMo-RL `policy.*` keys this worker accepts and does not read, and the split that drops them."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

__all__ = ["IGNORED_NEMO_RL_KEYS", "split_ignored_keys"]

# NeMo-RL `policy.*` keys this worker accepts and does not read (dotted paths below `policy`):
# every key NeMo-RL's policy TypedDicts or its example configs define that the config classes
# do not hold. A key listed here is dropped before structuring (with its whole subtree) and named in
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
        "learning_rate": "NeMo-RL's worker test configs carry it; optimizer.kwargs.lr is read",
        "checkpointing": "checkpoint cadence and paths belong to the controller",
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
        "dtensor_cfg.lora": "NeMo-RL's worker test configs carry it; lora_cfg is the key read",
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

"""Load a Hugging Face model (config, weights, tokenizer) for the policy worker.

Master weights are fp32; compute runs in `precision` through autocast. The attention implementation
is chosen here (`dtensor_cfg.attn_implementation`): `auto` is sdpa (eager for a model class without
an sdpa path, e.g. Gemma2, GPT-OSS; logged once), and with sequence packing the document-safe
kernel of the device (CUDA + bf16/fp16: our registered varlen kernel; otherwise sdpa's
packed-`position_ids` block-diagonal path, which needs `use_cache=False`). A configuration that
would attend across packed documents raises `ValueError` at load time, and a packed load is
verified by a perturbation probe (`check_document_isolation`).

Seams for other modules: a parallelize hook (FSDP2 / TP) would wrap the module returned by
`load_policy_model`; LoRA injection happens on that module before the optimizer is built.

The forward and the isolation probe are in `forward` (re-exported here for the worker).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from policyworker.shell.model import sources
from policyworker.shell.model.attention import VARLEN_ATTN_NAME, ensure_varlen_registered
from policyworker.shell.model.forward import (
    autocast_context,
    check_document_isolation,
    forward_hidden,
    forward_logits,
    set_training_mode,
    supports_chunked_lm_head,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "attn_the_model_supports",
    "autocast_context",
    "check_document_isolation",
    "forward_hidden",
    "forward_logits",
    "load_policy_model",
    "load_tokenizer",
    "resolve_attn_implementation",
    "reward_model_type",
    "section_enabled",
    "set_training_mode",
    "supports_chunked_lm_head",
]

log = logging.getLogger("policyworker")
_EAGER_FALLBACK_LOGGED: set[str] = set()  # model classes whose eager fallback was logged

ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flex_attention", "varlen")
# Kernels that isolate packed documents given restarted position_ids and attention_mask=None:
# sdpa / eager / flex_attention build a block-diagonal mask from the position resets
# (transformers' packed-sequence path); ours uses cu_seqlens.
_DOCUMENT_SAFE = ("sdpa", "eager", "flex_attention", VARLEN_ATTN_NAME)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_REWARD_CLASSES = {
    "bradley_terry": "AutoModelForSequenceClassification",
    "regression": "AutoModelForTokenClassification",
}


def section_enabled(section: Any) -> bool:
    """A config section is on when present and (if it has one) its `enabled` flag is true."""
    if section is None:
        return False
    if isinstance(section, Mapping):
        return bool(section.get("enabled", True))
    return bool(getattr(section, "enabled", True))


def _get(section: Any, key: str, default: Any = None) -> Any:
    if section is None:
        return default
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def reward_model_type(cfg: Any) -> str | None:
    """'bradley_terry' | 'regression' when the reward head is enabled, else None."""
    rm = _get(cfg, "reward_model_cfg")
    if not section_enabled(rm):
        return None
    kind = _get(rm, "reward_model_type", "bradley_terry")
    if kind not in _REWARD_CLASSES:
        msg = (
            f"reward_model_cfg.reward_model_type={kind!r} is not supported; "
            f"use one of {sorted(_REWARD_CLASSES)}"
        )
        raise ValueError(msg)
    return kind


def resolve_attn_implementation(
    requested: str | None, *, packing: bool, device: torch.device, precision: torch.dtype
) -> str:
    """The transformers attention name to load with.

    ValueError for an unsafe or impossible choice.
    """
    requested = requested or "auto"
    if requested not in ATTN_IMPLEMENTATIONS:
        msg = (
            f"dtensor_cfg.attn_implementation={requested!r} is not supported; "
            f"use one of {list(ATTN_IMPLEMENTATIONS)}"
        )
        raise ValueError(msg)
    if requested == "varlen":
        if device.type != "cuda":
            msg = (
                f"dtensor_cfg.attn_implementation='varlen' needs CUDA (device is {device}); "
                f"use 'auto' or 'sdpa' on CPU (packing then uses sdpa's position_ids path)"
            )
            raise ValueError(msg)
        if precision not in (torch.float16, torch.bfloat16):
            msg = (
                f"dtensor_cfg.attn_implementation='varlen' runs flash attention, which needs "
                f"precision bfloat16 or float16 (got {precision}); use 'auto' or 'sdpa'"
            )
            raise ValueError(msg)
        return ensure_varlen_registered()
    if requested == "auto":
        if packing and device.type == "cuda" and precision in (torch.float16, torch.bfloat16):
            return ensure_varlen_registered()
        return "sdpa"
    if packing and requested not in _DOCUMENT_SAFE:
        msg = (
            f"dtensor_cfg.attn_implementation={requested!r} would attend across packed "
            f"documents; use 'auto', 'sdpa' or 'varlen' with sequence_packing"
        )
        raise ValueError(msg)
    return requested


def load_tokenizer(name: str, *, local_files_only: bool = False) -> Any | None:
    """AutoTokenizer for `name`, or None when `name` is a local folder without tokenizer files."""
    if os.path.isdir(name) and not any(
        os.path.exists(os.path.join(name, f)) for f in _TOKENIZER_FILES
    ):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_hf_config(source: str, key: str, overrides: dict[str, Any], *, offline: bool) -> Any:
    """The HF config of `source`; a ValueError naming the key and what was looked for."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(
            source, local_files_only=offline, **overrides
        )
    except OSError as err:
        if os.path.isdir(source):
            where = "that folder has no config.json"
        elif offline:
            where = (
                "not a local folder, and not in the local Hugging Face cache while the Hub is "
                "not used (HF_HUB_OFFLINE is set, or the Hub is unreachable); download it "
                "where there is a network and copy the cache (HF_HOME) here"
            )
        else:
            where = "no such local folder, and no Hugging Face Hub model of that id could be read"
        msg = (
            f"{key}={source!r}: {where} ({err}); pass a folder that holds config.json and "
            f"the weights (as save_pretrained writes them), or a Hub model id"
        )
        raise ValueError(msg) from err


def _load_configs(cfg: Any, weights_from: str | None) -> tuple[Any, bool]:
    """The config to build the model from (`weights_from`'s when given, checked to describe the
    same model as `model_name`'s) and whether to read the Hub's cache only."""
    overrides = dict(_get(cfg, "hf_config_overrides") or {})
    sources.check_local_folder(cfg.model_name, "model_name", weights=weights_from is None)
    offline = sources.hub_local_files_only(cfg.model_name, "model_name")
    config = _load_hf_config(cfg.model_name, "model_name", overrides, offline=offline)
    if weights_from is None:
        return config, offline
    sources.check_local_folder(weights_from, "weights_path")
    weights_config = _load_hf_config(weights_from, "weights_path", overrides, offline=True)
    sources.check_same_model(config, weights_config, model=cfg.model_name, weights=weights_from)
    return weights_config, offline


def load_policy_model(
    cfg: Any, *, device: torch.device, weights_from: str | None = None
) -> tuple[torch.nn.Module, Any | None]:
    """Build the HF model of `cfg` in fp32 on `device` (and its tokenizer, or None).

    `weights_from` (an HF folder) replaces `model_name` as the weights source, keeping the
    tokenizer of `tokenizer.name` / `model_name`.
    """
    import transformers

    from policyworker.functional.dtypes import precision_dtype

    precision = precision_dtype(cfg.precision)
    packing = section_enabled(_get(cfg, "sequence_packing"))
    requested_attn = _get(cfg.dtensor_cfg, "attn_implementation", "auto")
    attn = resolve_attn_implementation(
        requested_attn, packing=packing, device=device, precision=precision
    )
    source = weights_from or cfg.model_name
    # Every edit below changes how the model runs, never which parameters it has or how they
    # are initialised or trained: the model stays the one the checkpoint describes.
    # - hf_config_overrides: the user's own edits of the model, applied as they asked.
    # - use_cache=False: only the forward's KV-cache behaviour (packed position_ids are ignored
    #   when a cache exists); no module or parameter depends on it.
    # - pad_token_id is deliberately NOT filled in. transformers builds
    #   `nn.Embedding(..., padding_idx=pad_token_id)`, and that row then never receives a
    #   gradient: filling in EOS as pad would freeze the embedding of the token that ends every
    #   turn. Nothing here reads the model's pad id: padding positions are masked by
    #   input_lengths, and score() gathers the last real token itself instead of HF's
    #   pad-searching classification forward.
    # - num_labels=1 for a reward head: a scalar score is what bradley_terry / regression mean;
    #   a checkpoint whose head has another size fails loudly in from_pretrained.
    # - attn_implementation picks the kernel only (packing safety is verified separately);
    #   dtype=float32 upcasts the stored weights exactly.
    config, offline = _load_configs(cfg, weights_from)
    tokenizer_name = _get(_get(cfg, "tokenizer"), "name") or cfg.model_name
    tokenizer = load_tokenizer(tokenizer_name, local_files_only=offline)
    config.use_cache = False
    kind = reward_model_type(cfg)
    auto_cls = getattr(transformers, _REWARD_CLASSES[kind] if kind else "AutoModelForCausalLM")
    if kind:
        config.num_labels = 1
    attn = attn_the_model_supports(auto_cls, config, attn, requested=requested_attn)
    model, info = auto_cls.from_pretrained(
        source,
        config=config,
        dtype=torch.float32,
        attn_implementation=attn,
        local_files_only=offline or weights_from is not None,
        output_loading_info=True,
    )
    if kind:
        sources.warn_if_untrained_head(source, info.get("missing_keys", ()), kind=kind)
    model.config.use_cache = False
    # Re-tie after loading: a tied checkpoint stores one tensor; this keeps lm_head a view of it.
    if (
        getattr(model.config, "tie_word_embeddings", False)
        and model.get_output_embeddings() is not None
    ):
        model.tie_weights()
    if _get(cfg.dtensor_cfg, "activation_checkpointing", False):  # recompute only, same math
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5.2x name
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    model.to(device)
    return model, tokenizer


def attn_the_model_supports(auto_cls: Any, config: Any, attn: str, *, requested: str | None) -> str:
    """`attn`, or 'eager' when `attn` is sdpa, the model class has no sdpa path (Gemma2, GPT-OSS)
    and the user left the choice to us ('auto'); logged once per model class."""
    if attn != "sdpa":
        return attn
    try:
        model_cls = auto_cls._model_mapping[type(config)]
    except (AttributeError, KeyError):  # remote code: transformers decides at construction
        return attn
    if getattr(model_cls, "_supports_sdpa", True):
        return attn
    if (requested or "auto") != "auto":
        msg = (
            f"dtensor_cfg.attn_implementation={requested!r}: {model_cls.__name__} has no sdpa "
            f"attention in transformers; use 'auto' (falls back to eager) or 'eager'"
        )
        raise ValueError(msg)
    if model_cls.__name__ not in _EAGER_FALLBACK_LOGGED:
        _EAGER_FALLBACK_LOGGED.add(model_cls.__name__)
        log.warning(
            "%s has no sdpa attention in transformers; attn_implementation 'auto' uses "
            "'eager' for it",
            model_cls.__name__,
        )
    return "eager"

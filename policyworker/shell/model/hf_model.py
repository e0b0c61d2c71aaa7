"""Load a Hugging Face model for the policy worker and run its forward.

Master weights are fp32; compute runs in `precision` through autocast. The attention implementation
is chosen here (`dtensor_cfg.attn_implementation`): `auto` is sdpa (eager for a model class without
an sdpa path, e.g. Gemma2, GPT-OSS; logged once), and with sequence packing the document-safe
kernel of the device (CUDA + bf16/fp16: our registered varlen kernel; otherwise sdpa's
packed-`position_ids` block-diagonal path, which needs `use_cache=False`). A configuration that
would attend across packed documents raises `ValueError` at load time, and a packed load is
verified by a perturbation probe (`check_document_isolation`).

Seams for other modules: a parallelize hook (FSDP2 / TP) would wrap the module returned by
`load_policy_model`; LoRA injection happens on that module before the optimizer is built.

Why it is over 400 lines: loading, the attention-implementation rule and the packed-document
isolation probe must agree on one decision (which kernel is document-safe on which device), so
they are kept in one module.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from policyworker.shell.model.attention import VARLEN_ATTN_NAME, ensure_varlen_registered

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


def load_tokenizer(name: str) -> Any | None:
    """AutoTokenizer for `name`, or None when `name` is a local folder without tokenizer files."""
    if os.path.isdir(name) and not any(
        os.path.exists(os.path.join(name, f)) for f in _TOKENIZER_FILES
    ):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_hf_config(source: str, key: str, overrides: dict[str, Any]) -> Any:
    """The HF config of `source`; a ValueError naming the key and what was looked for."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(source, **overrides)
    except OSError as err:
        where = (
            "that folder has no config.json"
            if os.path.isdir(source)
            else "no such local folder, and no Hugging Face Hub model of that id could be read"
        )
        msg = (
            f"{key}={source!r}: {where} ({err}); pass a folder that holds config.json and "
            f"the weights (as save_pretrained writes them), or a Hub model id"
        )
        raise ValueError(msg) from err


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
    overrides = dict(_get(cfg, "hf_config_overrides") or {})
    config = _load_hf_config(
        source, "model_name" if weights_from is None else "weights_from", overrides
    )
    tokenizer_name = _get(_get(cfg, "tokenizer"), "name") or cfg.model_name
    tokenizer = load_tokenizer(tokenizer_name)
    config.use_cache = False
    kind = reward_model_type(cfg)
    auto_cls = getattr(transformers, _REWARD_CLASSES[kind] if kind else "AutoModelForCausalLM")
    if kind:
        config.num_labels = 1
    attn = attn_the_model_supports(auto_cls, config, attn, requested=requested_attn)
    model = auto_cls.from_pretrained(
        source, config=config, dtype=torch.float32, attn_implementation=attn
    )
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


def autocast_context(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`; a no-op context for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def set_training_mode(model: torch.nn.Module, training: bool) -> None:
    """``model.train(training)``, skipped where it would change nothing.

    ``nn.Module.train`` sets the flag on every module through ``nn.Module.__setattr__``: 0.8 ms
    for a 28-layer decoder's 371 modules on a 2-core CPU, host time before the first kernel of
    every ``get_logprobs``. A call in the mode the model is already in (``get_logprobs`` after
    ``get_logprobs`` or before ``get_reference_policy_logprobs``; ``train`` after ``train``)
    costs a read-only walk instead (0.07 ms). A module whose class overrides ``train`` (other
    than transformers' root override, which does nothing more when the mode is unchanged)
    always gets the call: its override may do more than set the flag.
    """
    from transformers import PreTrainedModel

    plain_train = (torch.nn.Module.train, PreTrainedModel.train)
    stack: list[torch.nn.Module | None] = [model]
    while stack:
        module = stack.pop()
        if module is None:  # a registered slot left empty (e.g. ``bias = None`` submodules)
            continue
        if module.training != training or type(module).train not in plain_train:
            model.train(training)
            return
        # _modules, not children(): the generator per module costs more than the walk itself.
        stack.extend(module._modules.values())


def _model_kwargs(input_ids, position_ids, attention_mask, cu_seqlens, max_seqlen):
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "use_cache": False,
    }
    if cu_seqlens is not None:  # read by our varlen kernel; ignored (by name) by the others
        kwargs.update(
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
        )
    return kwargs


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    autocast_dtype: torch.dtype = torch.float32,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Logits [B, S, V] (or classification logits) of one microbatch under autocast."""
    kwargs = _model_kwargs(
        input_ids,
        position_ids,
        attention_mask,
        cu_seqlens if _uses_varlen(model) else None,
        max_seqlen,
    )
    with autocast_context(input_ids.device, autocast_dtype):
        out = model(**kwargs)
    return out.logits if hasattr(out, "logits") else out[0]


def forward_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None,
    autocast_dtype: torch.dtype = torch.float32,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    through_root: bool = False,
) -> torch.Tensor:
    """Last hidden states [B, S, H] of the base model (no LM / classification head).

    `through_root=True` calls the whole model (a causal LM's head on its last position only)
    and captures the base model's output with a hook: FSDP2 gathers parameters in the hooks of
    the module that is called, so calling the base model directly would skip the root's.
    """
    # Any: a Hugging Face model's base_model_prefix/config are class attributes torch can't type.
    hf_model = cast(Any, model)
    base = getattr(model, hf_model.base_model_prefix)
    kwargs = _model_kwargs(
        input_ids, position_ids, None, cu_seqlens if _uses_varlen(model) else None, max_seqlen
    )
    if not through_root:
        with autocast_context(input_ids.device, autocast_dtype):
            out = base(**kwargs)
        return out.last_hidden_state
    captured: list[torch.Tensor] = []

    def keep(_module, _args, out):
        captured.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    if type(model).__name__.endswith("ForCausalLM"):
        kwargs["logits_to_keep"] = 1
    handle = base.register_forward_hook(keep)
    try:
        with autocast_context(input_ids.device, autocast_dtype):
            model(**kwargs)
    finally:
        handle.remove()
    return captured[-1]


def supports_chunked_lm_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly `lm_head(last_hidden_state)` (a plain causal LM head)."""
    # Any: a Hugging Face model's methods and class attributes are not on torch's nn.Module.
    hf_model = cast(Any, model)
    config = hf_model.config
    return (
        type(model).__name__.endswith("ForCausalLM")
        and hf_model.get_output_embeddings() is not None
        and hasattr(model, hf_model.base_model_prefix)
        and getattr(config, "final_logit_softcapping", None) is None
        and getattr(config, "logits_scaling", None) in (None, 1, 1.0)
    )


def _uses_varlen(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == VARLEN_ATTN_NAME


@torch.no_grad()
def check_document_isolation(model: torch.nn.Module, *, autocast_dtype: torch.dtype) -> None:
    """Raise ValueError if, in a packed row [A | B], B's logits depend on document A's tokens."""
    device = next(model.parameters()).device
    # Any: a Hugging Face model's config is a dynamic attribute torch's nn.Module can't type.
    hf_config = cast(Any, model).config
    vocab = int(hf_config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    doc_a = torch.randint(0, vocab, (5,), generator=gen)
    doc_b = torch.randint(0, vocab, (6,), generator=gen)
    position_ids = torch.cat([torch.arange(5), torch.arange(6)])[None].to(device)
    was_training = model.training
    model.eval()
    try:
        outs = []
        for first in (doc_a, (doc_a + 1) % vocab):
            ids = torch.cat([first, doc_b])[None].to(device)
            outs.append(
                forward_logits(
                    model,
                    ids,
                    position_ids=position_ids,
                    autocast_dtype=autocast_dtype,
                    cu_seqlens=torch.tensor([0, 5, 11], dtype=torch.int32, device=device),
                    max_seqlen=6,
                )[0, 5:].float()
            )
            if hasattr(outs[-1], "full_tensor"):  # vocab-parallel (TP) logits
                outs[-1] = outs[-1].full_tensor()
    finally:
        model.train(was_training)
    diff = (outs[0] - outs[1]).abs().max().item()
    if diff > 1e-3 * max(1.0, outs[0].abs().max().item()):
        msg = (
            f"attention implementation {hf_config._attn_implementation!r} lets packed "
            f"documents attend to each other (logits of a document changed by {diff:.3g} "
            f"when the previous document changed); disable sequence_packing or use "
            f"attn_implementation 'auto'/'sdpa'"
        )
        raise ValueError(msg)

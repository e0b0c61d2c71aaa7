"""The forward of a loaded Hugging Face model: logits or hidden states of one microbatch under
autocast, the train/eval switch, and the packed-document isolation probe.

The probe (`check_document_isolation`) verifies, on the loaded model, the kernel choice that
`hf_model.resolve_attn_implementation` made: in a packed row, no document may attend to another.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch

from policyworker.shell.model.attention import VARLEN_ATTN_NAME

__all__ = [
    "autocast_context",
    "check_document_isolation",
    "forward_hidden",
    "forward_logits",
    "set_training_mode",
    "supports_chunked_lm_head",
]


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
    """Logits [B, S, V] of one microbatch under autocast; per-token scores [B, S, 1] of a
    sequence-classification (reward) model, whose HF forward would pool them at a pad-searched
    last token instead (the losses pick the last real token by `input_lengths`)."""
    if type(model).__name__.endswith("ForSequenceClassification"):
        return _per_token_scores(
            model,
            input_ids,
            position_ids=position_ids,
            autocast_dtype=autocast_dtype,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
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


def _per_token_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, *, autocast_dtype: torch.dtype, **kwargs: Any
) -> torch.Tensor:
    # Any: a Hugging Face model's `score` head is a dynamic attribute torch's nn.Module can't type.
    head = cast(Any, model).score
    if hasattr(head.weight, "device_mesh"):
        msg = (
            f"{type(model).__name__}: a reward model's per-token scores are computed from its "
            f"base model and score head directly, which FSDP2 / TP sharding does not gather; "
            f"train or use it in one process (no dtensor_cfg sharding)"
        )
        raise ValueError(msg)
    hidden = forward_hidden(model, input_ids, autocast_dtype=autocast_dtype, **kwargs)
    with autocast_context(input_ids.device, autocast_dtype):
        return head(hidden)


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

"""Document-safe attention for packed sequences, registered with transformers' AttentionInterface.

A packed microbatch is one row of several whole sequences whose `position_ids` restart at 0 at
each sequence start. The kernel registered here as ``policyworker_varlen`` derives the document
boundaries (``cu_seqlens``) from those position ids (or takes ``cu_seq_lens_q``/``max_length_q``
passed through the model's kwargs) and runs

- on CUDA with fp16/bf16 inputs: torch's flash varlen kernel (``aten._flash_attention_forward``
  with cumulative sequence lengths, causal, GQA native; its autograd formula is torch's);
- otherwise (CPU, fp32, or a torch built without flash attention): flex attention with a
  block-diagonal causal document mask built from the same boundaries (forward on every device;
  backward on CUDA only).

Registration is idempotent and happens on first use (`ensure_varlen_registered`), never at import.
Because the name is not in transformers' mask interface, transformers builds no 4-D mask for it
and passes ``attention_mask=None``; documents are isolated by the kernel alone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "VARLEN_ATTN_NAME",
    "cu_seqlens_from_position_ids",
    "ensure_varlen_registered",
    "varlen_attention_forward",
    "varlen_kernel_available",
]

VARLEN_ATTN_NAME = "policyworker_varlen"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def ensure_varlen_registered() -> str:
    """Register the varlen kernel with transformers' AttentionInterface once; return its name."""
    from transformers import AttentionInterface

    if VARLEN_ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_ATTN_NAME, varlen_attention_forward)
    return VARLEN_ATTN_NAME


def varlen_kernel_available(device: torch.device) -> bool:
    """True when `device` is CUDA and this torch was built with flash attention (varlen)."""
    return device.type == "cuda" and torch.backends.cuda.is_flash_attention_available()


def cu_seqlens_from_position_ids(position_ids_BT: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative document boundaries of the flattened [B*T] tokens and the longest document.

    A document starts at every row start and wherever the position does not continue the
    previous one (`pos[t] != pos[t-1] + 1`), e.g. positions [[0,1,2,0,1,0]] -> [0,3,5,6], 3.
    """
    pos = position_ids_BT.reshape(position_ids_BT.shape[0], -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    start_idx = torch.nonzero(starts.reshape(-1), as_tuple=False).reshape(-1)
    total = torch.tensor([pos.numel()], device=pos.device, dtype=start_idx.dtype)
    cu = torch.cat([start_idx, total]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max().item())
    return cu, max_len


def _document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return torch.repeat_interleave(
        torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=num_tokens
    )


def _flash_varlen(q, k, v, cu, max_len, scaling):  # q/k/v: [N, H, D], K/V may have fewer heads
    # The aten op directly, not torch.nn.attention.varlen.varlen_attn: that wrapper is a Python
    # custom op whose dispatch cost ~1 ms of host time per layer call on an H200 train step,
    # where the compiled layer forward is launch-bound; the kernel and its backward are the same.
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scaling
    )
    return out[0]


_BLOCK_MASK_CACHE: dict[str, Any] = {}


def _flex_document_attention(q, k, v, cu, scaling):  # q/k/v: [1, H, N, D]
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_tokens = q.shape[2]
    key = (cu.device, tuple(cu.tolist()))
    if _BLOCK_MASK_CACHE.get("key") != key:
        doc = _document_ids(cu, num_tokens)

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        _BLOCK_MASK_CACHE["key"] = key
        _BLOCK_MASK_CACHE["mask"] = create_block_mask(
            document_causal, None, None, num_tokens, num_tokens, device=q.device
        )
    gqa = q.shape[1] != k.shape[1]
    return flex_attention(
        q, k, v, block_mask=_BLOCK_MASK_CACHE["mask"], scale=scaling, enable_gqa=gqa
    )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q/k/v [B, H, T, D] -> ([B, T, H, D], None), per document.

    Documents come from ``cu_seq_lens_q`` (+ ``max_length_q``) when the caller passes them, else
    from ``position_ids``. The kernel is always causal within a document.
    """
    if attention_mask is not None:
        msg = (
            f"attention_mask of shape {tuple(attention_mask.shape)} was passed to "
            f"{VARLEN_ATTN_NAME}, which takes document boundaries from position_ids; "
            f"pass attention_mask=None with packed position_ids"
        )
        raise ValueError(msg)
    if dropout != 0.0:
        msg = f"{VARLEN_ATTN_NAME} has no attention dropout (got dropout={dropout}); set it to 0"
        raise ValueError(msg)
    batch, num_q_heads, num_tokens, head_dim = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and batch == 1:
        cu = cu.to(device=query.device, dtype=torch.int32)
        max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max().item())
    else:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(num_tokens, device=query.device)[None]
        # a model's own positions (no position_ids given to it) are one row for the whole batch
        position_ids = position_ids.to(query.device).expand(batch, -1)
        cu, max_len = cu_seqlens_from_position_ids(position_ids)
    flat = batch * num_tokens
    if query.is_cuda and query.dtype not in _FLASH_DTYPES and torch.is_autocast_enabled("cuda"):
        # rotary embeddings promote q/k to fp32 under autocast; sdpa is cast back by autocast,
        # so do the same before the flash kernel
        compute = torch.get_autocast_dtype("cuda")
        if compute in _FLASH_DTYPES:
            query, key, value = query.to(compute), key.to(compute), value.to(compute)
    if varlen_kernel_available(query.device) and query.dtype in _FLASH_DTYPES:
        q = query.transpose(1, 2).reshape(flat, num_q_heads, head_dim)
        k = key.transpose(1, 2).reshape(flat, key.shape[1], head_dim)
        v = value.transpose(1, 2).reshape(flat, value.shape[1], value.shape[-1])
        out = _flash_varlen(q, k, v, cu, max_len, scaling)
        return out.reshape(batch, num_tokens, num_q_heads, -1), None
    q = query.transpose(0, 1).reshape(1, num_q_heads, flat, head_dim)
    k = key.transpose(0, 1).reshape(1, key.shape[1], flat, head_dim)
    v = value.transpose(0, 1).reshape(1, value.shape[1], flat, value.shape[-1])
    out = _flex_document_attention(q, k, v, cu, scaling)  # [1, H, B*T, D]
    out = out.reshape(num_q_heads, batch, num_tokens, -1).permute(1, 2, 0, 3).contiguous()
    return out, None

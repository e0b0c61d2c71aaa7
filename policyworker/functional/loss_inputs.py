"""Reading a loss's inputs: the keyword logprobs, the ``[:, 1:]`` per-token slices and the masks,
each checked against the shape of ``next_token_logprobs`` with a ``ValueError`` naming the key.

A loss calls these on its own microbatch, so a loss called outside ``train()`` refuses bad input
by itself. Shape legend: ``B`` rows, ``S`` padded length, ``T = S - 1``. All functions are pure.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["logprobs_input", "masks_from_data", "next_token_slice", "require_tensor"]


def require_tensor(data: Mapping[str, Any], key: str, owner: str) -> Tensor:
    """``data[key]``, or a ValueError naming the missing key and the keys present."""
    if key not in data:
        msg = (
            f"{owner} needs data[{key!r}], which is missing (keys present: {sorted(data)}); "
            f"add it to the batch"
        )
        raise ValueError(msg)
    value = data[key]
    if not isinstance(value, Tensor):
        msg = f"{owner}: data[{key!r}] must be a torch.Tensor, got {type(value).__name__}"
        raise ValueError(msg)
    return value


def logprobs_input(inputs: Mapping[str, Tensor], owner: str) -> Tensor:
    """The ``next_token_logprobs`` keyword input [B, T], promoted to at least float32."""
    if set(inputs) != {"next_token_logprobs"}:
        msg = (
            f"{owner} takes exactly the keyword input next_token_logprobs [B, S-1], got "
            f"{sorted(inputs)}; its input_type is LossInputType.LOGPROB"
        )
        raise ValueError(msg)
    logprobs_BT = inputs["next_token_logprobs"]
    if logprobs_BT.ndim != 2:
        msg = f"{owner}: next_token_logprobs must be [B, S-1], got shape {tuple(logprobs_BT.shape)}"
        raise ValueError(msg)
    return logprobs_BT.to(torch.promote_types(logprobs_BT.dtype, torch.float32))


def next_token_slice(data: Mapping[str, Any], key: str, like_BT: Tensor, owner: str) -> Tensor:
    """``data[key][:, 1:]`` in the dtype of ``like_BT``, after checking it is [B, T + 1]."""
    value_BS = require_tensor(data, key, owner)
    B, T = like_BT.shape
    if tuple(value_BS.shape) != (B, T + 1):
        msg = (
            f"{owner}: data[{key!r}] has shape {tuple(value_BS.shape)} but next_token_logprobs is "
            f"{(B, T)}, so it must be {(B, T + 1)} (per-token tensors are [B, S])"
        )
        raise ValueError(msg)
    return value_BS[:, 1:].to(like_BT.dtype)


def masks_from_data(
    data: Mapping[str, Any], like_BT: Tensor, owner: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(token_mask_BT, sample_mask_B, mask_BT = token_mask · sample_mask) in ``like_BT``'s dtype."""
    token_mask_BT = next_token_slice(data, "token_mask", like_BT, owner)
    sample_mask_B = require_tensor(data, "sample_mask", owner)
    if tuple(sample_mask_B.shape) != (like_BT.shape[0],):
        msg = (
            f"{owner}: data['sample_mask'] has shape {tuple(sample_mask_B.shape)}, "
            f"expected [B] = {(like_BT.shape[0],)}"
        )
        raise ValueError(msg)
    sample_mask_B = sample_mask_B.to(like_BT.dtype)
    return token_mask_BT, sample_mask_B, token_mask_BT * sample_mask_B[:, None]

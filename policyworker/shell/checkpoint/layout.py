"""Checkpoint layout: folder and file names, and which box of each HF tensor this rank writes.

An HF tensor is a box (a region) of one model tensor; `hf_layout` names the boxes (from the
pieces transformers' save-time conversion writes), the pure math (`plan_safetensors_files`
packs them into files) lives in `policyworker.functional.safetensors_layout` and is
re-exported here; `_locals` says which
part of each box this rank's local shard covers (replicas: the one at coordinate 0). Only
placements other than Shard/Replicate (e.g. the `_StridedShard` of 2-D TP+FSDP) fall back to a
per-tensor gather. Nothing here touches a file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
from torch import nn

from policyworker.functional.names import (
    CheckpointPiece,
    canonical_name,
    contiguous_strides,
    is_lora_param,
)
from policyworker.functional.safetensors_layout import (  # re-exported: the layout's names
    MAX_FILE_BYTES,
    Box,
    FilePlan,
    HFTensor,
    box_of_view,
    plan_safetensors_files,
)
from policyworker.shell.parallel.plans import reshard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "FilePlan",
    "HFTensor",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "MAX_FILE_BYTES",
    "MODEL_DIR",
    "OPTIM_DIR",
    "REFERENCE_DIR",
    "hf_layout",
    "plan_safetensors_files",
    "saved_keys",
]

MODEL_DIR = "model"
OPTIM_DIR = "optim"
REFERENCE_DIR = "reference"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "policyworker_checkpoint.json"
FORMAT_VERSION = 1
# Files are written by this many threads per rank (pwrite and DCP's writer release the GIL): one
# thread leaves a fast disk idle while it copies and syncs. Read at each save (bench/ varies it).
WRITER_THREADS = min(8, os.cpu_count() or 1)


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not fit the model."""


# ------------------------------------------------------------------------------ HF names


def saved_keys(specs: Mapping[str, Any], *, tie_word_embeddings: bool) -> dict[str, str]:
    """`{state key: canonical name}` of what `save_pretrained` saves (no LoRA, no tied head)."""
    names = {key: canonical_name(key) for key in specs if not is_lora_param(key)}
    return {k: n for k, n in names.items() if not (tie_word_embeddings and n == "lm_head.weight")}


def hf_layout(
    specs: Mapping[str, tuple[Sequence[int], torch.dtype]],
    *,
    tie_word_embeddings: bool,
    pieces: Mapping[str, Sequence[CheckpointPiece]],
) -> list[HFTensor]:
    """The HF checkpoint tensors of a model state `{key: (shape, dtype)}`, in state order.

    Wrapper prefixes are stripped, LoRA adapter tensors skipped, a tied `lm_head.weight`
    dropped, and each tensor cut into its checkpoint `pieces` (by canonical name; the shell
    gets them from transformers' own save-time conversion, `refit.hf_names.checkpoint_layout`,
    as the refit does), each a box of the tensor.

    Raises:
        CheckpointError: a piece is not a box of its tensor (e.g. a transposed layout).
    """
    out: list[HFTensor] = []
    for key, name in saved_keys(specs, tie_word_embeddings=tie_word_embeddings).items():
        shape, dtype = tuple(specs[key][0]), specs[key][1]
        base = torch.empty(shape, dtype=dtype, device="meta")
        for piece in pieces[name]:
            trailing = contiguous_strides(shape)[len(shape) - len(piece.shape) :]
            strides = zip(piece.shape, piece.stride, trailing, strict=True)
            if len(piece.shape) > len(shape) or any(n > 1 and s != t for n, s, t in strides):
                msg = (
                    f"checkpoint tensor {piece.name!r} is not a box of {name!r} {list(shape)} "
                    f"(strides {list(piece.stride)}); the HF writer writes boxes only"
                )
                raise CheckpointError(msg)
            box = box_of_view(piece.view_of(base), shape)
            out.append(HFTensor(piece.name, key, box, piece.shape, dtype))
    return out


# ------------------------------------------------------------------------------ local pieces


@attrs.frozen
class _Local:
    """This rank's view of one model tensor: the local tensor and the box it covers."""

    tensor: torch.Tensor
    box: Box
    owner: bool  # writes the bytes of this box (one rank per replica set)
    placements: Any = None  # DTensor placements (None for plain tensors)
    mesh: Any = None
    gathered: bool = False


def _full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def _dtensor_box(t: Any) -> tuple[Box, bool] | None:
    """Box of a DTensor's local shard and whether this rank owns it; None for other placements."""
    from torch.distributed.tensor import Replicate, Shard

    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    mesh = t.device_mesh
    owner, shards, strided = True, [], []
    for axis, placement in enumerate(t.placements):
        if type(placement) is Replicate:
            owner = owner and coord[axis] == 0
        elif type(placement) is Shard:
            shards.append((axis, placement.dim))
        elif type(placement).__name__ == "_StridedShard":  # FSDP2 over TP: split after later axes
            strided.append((axis, placement.dim))
            later = math.prod(
                mesh.size(a)
                for a, p in enumerate(t.placements)
                if a > axis and type(p) is Shard and p.dim == placement.dim
            )
            if placement.split_factor != later:
                return None
        else:
            return None
    box = [list(b) for b in _full_box(t.shape)]
    for axis, dim in shards + strided:
        lo, hi = box[dim]
        chunk = -(-(hi - lo) // mesh.size(axis))
        s = min(lo + coord[axis] * chunk, hi)
        box[dim] = [s, min(s + chunk, hi)]
    result = tuple((a, b) for a, b in box)
    if tuple(b - a for a, b in result) != tuple(t.to_local().shape):
        return None
    return result, owner


def _locals(state: Mapping[str, torch.Tensor], *, rank: int, world_size: int) -> dict[str, _Local]:
    """Local pieces of every state tensor, in state order (collective for gathered fallbacks)."""
    out: dict[str, _Local] = {}
    for i, (key, t) in enumerate(state.items()):
        t = t.detach()
        if hasattr(t, "device_mesh"):
            dt = cast("DTensor", t)
            found = _dtensor_box(dt)
            if found is None:  # unusual placement: gather this one tensor
                out[key] = _Local(
                    dt.full_tensor(),
                    _full_box(dt.shape),
                    rank == 0,
                    dt.placements,
                    dt.device_mesh,
                    gathered=True,
                )
            else:
                out[key] = _Local(dt.to_local(), found[0], found[1], dt.placements, dt.device_mesh)
        else:
            out[key] = _Local(t, _full_box(t.shape), i % world_size == rank)
    return out


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Live params + persistent buffers (sharded form: FSDP2 roots are resharded first)."""
    reshard(model)
    return model.state_dict(keep_vars=True)


def _specs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}

"""Loading HF safetensors weights: validate headers and names before any parameter changes,
read this rank's slices into staging on several threads, and return the commit that copies them
in. Any layout: each rank reads only the slices its shards cover.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

import policyworker.shell.checkpoint.layout as checkpoint_layout_settings
from policyworker.functional.safetensors_layout import Box, HFTensor, intersect_boxes
from policyworker.shell.checkpoint.folders import validate_hf_folder
from policyworker.shell.checkpoint.layout import (
    CheckpointError,
    _Local,
    _locals,
    _model_state,
    _specs,
)
from policyworker.shell.checkpoint.safetensors_io import model_hf_layout
from policyworker.shell.checkpoint.saver import on_threads

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["load_hf_weights"]


def _check_names(
    model_layout: Sequence[HFTensor],
    found: Mapping[str, tuple[pathlib.Path, dict[str, Any]]],
    folder: pathlib.Path,
) -> None:
    missing = [t.name for t in model_layout if t.name not in found]
    wrong = [
        f"{t.name}: file {found[t.name][1]['shape']} vs model {list(t.shape)}"
        for t in model_layout
        if t.name in found and list(found[t.name][1]["shape"]) != list(t.shape)
    ]
    if missing or wrong:
        msg = (
            f"checkpoint {str(folder)!r} does not fit the model: missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, shape mismatches {wrong[:8]}; load a "
            f"checkpoint saved from this model architecture and size"
        )
        raise CheckpointError(msg)


def load_hf_weights(
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    parallel: Any,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Callable[[], None]:
    """Read an HF safetensors folder into staging for this rank's shards; returns the commit.

    Everything is validated and read before the returned callable copies into `state` (default:
    the live model), so a failed load leaves the model unchanged. Works for any layout: each
    rank reads only the slices its shards cover.
    """
    from safetensors import safe_open

    folder = pathlib.Path(folder)
    found = validate_hf_folder(folder)
    live = _model_state(model)
    layout = model_hf_layout(model, _specs(live))
    _check_names(layout, found, folder)
    locals_ = _locals(live, rank=parallel.rank, world_size=parallel.world_size)
    in_layout = {t.key for t in layout}
    staging = {
        k: torch.empty(tuple(b - a for a, b in loc.box), dtype=loc.tensor.dtype)
        for k, loc in locals_.items()
        if k in in_layout
    }
    by_file: dict[pathlib.Path, list[tuple[HFTensor, Box]]] = {}
    for t in layout:
        sub = intersect_boxes(t.box, locals_[t.key].box)
        if sub is not None:
            by_file.setdefault(found[t.name][0], []).append((t, sub))

    def read_file(file: pathlib.Path) -> None:
        handle = safe_open(str(file), framework="pt")
        for t, sub in by_file[file]:
            loc = locals_[t.key]
            squeeze = len(t.box) - len(t.shape)
            src = tuple(
                slice(a - b0, b - b0)
                for (a, b), (b0, _) in zip(sub[squeeze:], t.box[squeeze:], strict=True)
            )
            block = handle.get_slice(t.name)[src] if src else handle.get_tensor(t.name)
            dst = tuple(slice(a - lb, b - lb) for (a, b), (lb, _) in zip(sub, loc.box, strict=True))
            staging[t.key][dst] = block.reshape(staging[t.key][dst].shape)

    # one file per thread: a cold read keeps several disk requests in flight (the copies out of
    # the mapped file release the GIL); the boxes are disjoint, so the staging writes never meet
    on_threads(
        read_file,
        sorted(by_file),
        threads=checkpoint_layout_settings.WRITER_THREADS,
        name="checkpoint-read",
    )
    target = live if state is None else state

    # Keys outside the layout (a tied lm_head) alias a loaded tensor: fill them from it.
    aliases = {
        k: next(o for o in staging if live[o] is live[k])
        for k in target
        if k in live and k not in staging and any(live[o] is live[k] for o in staging)
    }

    def commit() -> None:
        with torch.no_grad():
            for key, value in staging.items():
                _copy_into(target[key], value, locals_[key])
            for key, source in aliases.items():
                if target[key] is not target[source]:
                    _copy_into(target[key], staging[source], locals_[source])

    return commit


def _copy_into(dest: torch.Tensor, value: torch.Tensor, local: _Local) -> None:
    dest = dest.detach()
    if hasattr(dest, "device_mesh"):
        ddest = cast("DTensor", dest)
        if local.gathered:  # full value on every rank: keep this rank's part of the placement
            from torch.distributed.tensor import DTensor, Replicate

            full = DTensor.from_local(
                value.to(ddest.device),
                ddest.device_mesh,
                [Replicate()] * ddest.device_mesh.ndim,
                run_check=False,
            )
            value = full.redistribute(ddest.device_mesh, ddest.placements).to_local()
        dest = ddest.to_local()
    dest.copy_(value)

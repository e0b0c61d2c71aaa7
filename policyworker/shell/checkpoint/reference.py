"""The reference model's weights in a checkpoint (`weights_path/reference/`): written once, then
hard-linked from the previous save's folder for as long as the reference tensors are unchanged
(the reference policy of an RL run never trains, so most saves only link)."""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from policyworker.shell.checkpoint.commit import _all_ranks_max
from policyworker.shell.checkpoint.layout import INDEX_FILE
from policyworker.shell.checkpoint.safetensors_io import save_hf_weights
from policyworker.shell.checkpoint.saver import AsyncSaver

__all__ = ["save_reference"]


def _fingerprint(ref: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    return (id(ref),) + tuple((k, v.data_ptr(), v._version) for k, v in ref.items())


def _link_reference(src: pathlib.Path, dst: pathlib.Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def save_reference(
    model: nn.Module,
    parallel: Any,
    saver: AsyncSaver,
    ref: Mapping[str, torch.Tensor],
    final: pathlib.Path,
    tmp: pathlib.Path,
) -> list[Callable[[], None]]:
    """Hard-link the last save's reference files while the reference is unchanged, else write."""
    fp = _fingerprint(ref)
    last = saver.last_reference
    can_link = int(last is not None and last[1] == fp and (last[0] / INDEX_FILE).is_file())
    can_link = -_all_ranks_max(parallel, -can_link)  # min over ranks
    saver.last_reference = (final, fp)
    if can_link:
        assert last is not None
        return [lambda: _link_reference(last[0], tmp)] if parallel.rank == 0 else []
    return [save_hf_weights(model, tmp, parallel=parallel, state=ref, write_config=False)]

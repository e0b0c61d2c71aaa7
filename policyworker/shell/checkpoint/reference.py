"""The reference model's weights in a checkpoint (`weights_path/reference/`): written once, then
hard-linked from the previous save's folder for as long as the reference tensors are unchanged
(the reference policy of an RL run never trains, so most saves only link).

The links are made while staging, under the folder's lock, and only from the very folder this
worker committed (same inode): another process saving into the same path may have replaced it,
and its reference is not ours. Otherwise the reference is written."""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from policyworker.shell.checkpoint.commit import _all_ranks_max, _inode, _locked
from policyworker.shell.checkpoint.layout import INDEX_FILE
from policyworker.shell.checkpoint.safetensors_io import save_hf_weights
from policyworker.shell.checkpoint.saver import AsyncSaver

__all__ = ["save_reference"]


def _fingerprint(ref: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    return (id(ref),) + tuple((k, v.data_ptr(), v._version) for k, v in ref.items())


def _link_reference(src: pathlib.Path, inode: int | None, dst: pathlib.Path) -> bool:
    """Link (or copy) every file of `src` into `dst` if `src` is still the folder with `inode`;
    False (and `dst` emptied) when it is not, or a file went away meanwhile."""
    with _locked([src.parent]):  # a commit swapping `src` out holds the same lock
        if inode is None or _inode(src) != inode or not (src / INDEX_FILE).is_file():
            return False
        try:
            for f in src.iterdir():
                try:
                    os.link(f, dst / f.name)
                except OSError:  # no hard links here (another filesystem)
                    shutil.copy2(f, dst / f.name)
        except OSError:
            for f in dst.iterdir():  # unlinking a link leaves the source intact
                f.unlink()
            return False
    return True


def save_reference(
    model: nn.Module,
    parallel: Any,
    saver: AsyncSaver,
    ref: Mapping[str, torch.Tensor],
    final: pathlib.Path,
    tmp: pathlib.Path,
) -> list[Callable[[], None]]:
    """Hard-link the last save's reference files while the reference is unchanged, else write.

    `tmp` exists (rank 0 created it); the links are made now, on rank 0.
    """
    fp = _fingerprint(ref)
    last = saver.last_reference
    can_link = int(last is not None and last[1] == fp)
    can_link = -_all_ranks_max(parallel, -can_link)  # min over ranks
    saver.last_reference = (final, fp, _inode(tmp))  # after the commit, `final` is this folder
    if can_link and last is not None:
        failed = parallel.rank == 0 and not _link_reference(last[0], last[2], tmp)
        if not _all_ranks_max(parallel, int(failed)):
            return []
    return [save_hf_weights(model, tmp, parallel=parallel, state=ref, write_config=False)]

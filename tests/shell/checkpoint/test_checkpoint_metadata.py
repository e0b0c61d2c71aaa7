"""A DCP `.metadata` that lists an item without its storage entry is refused by name: read back
and refused at save (before the commit), refused at load before any state changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

import policyworker.shell.checkpoint.dcp as dcp
from policyworker.shell import checkpoint as ck
from tests.shell.checkpoint import checkpoint_crash_child as child

STEP = "optim.state.0.weight.step"


def _trained_worker(seed: int = 0) -> child.SimpleWorker:
    worker = child.SimpleWorker(child.build_model(seed=seed))
    worker.model(torch.ones(1, 256)).sum().backward()
    worker.optimizer.step()
    worker.optimizer.zero_grad()
    return worker


def _optim_metadata(root):
    folder = next((root / "o").rglob(".metadata")).parent
    return folder, FileSystemReader(str(folder)).read_metadata()


def _without(metadata, fqn):
    kept = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    return dataclasses.replace(metadata, storage_data=kept)


def test_a_complete_save_has_every_item_stored_and_a_dropped_entry_is_named(tmp_path):
    worker = _trained_worker()
    ck.save_checkpoint(worker, tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    _, metadata = _optim_metadata(tmp_path)
    assert dcp.unstored_items(metadata) == []
    assert dcp.unstored_items(_without(metadata, STEP)) == [STEP]
    assert dcp.unstored_items(_without(metadata, "extra")) == ["extra"]  # a bytes item


def test_a_load_of_a_metadata_without_an_items_data_is_refused_before_state_changes(
    tmp_path, monkeypatch
):
    saved = _trained_worker()
    ck.save_checkpoint(saved, tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    folder, metadata = _optim_metadata(tmp_path)
    real = FileSystemReader.read_metadata

    def read_metadata(self):
        if str(self.path) == str(folder):
            return _without(metadata, STEP)
        return real(self)

    monkeypatch.setattr(FileSystemReader, "read_metadata", read_metadata)
    loader = child.SimpleWorker(child.build_model(seed=1))
    before = [p.detach().clone() for p in loader.model.parameters()]
    with pytest.raises(ck.CheckpointError, match=r"without their data; it is incomplete"):
        ck.load_checkpoint(loader, tmp_path / "w", tmp_path / "o")
    assert all(torch.equal(a, b) for a, b in zip(before, loader.model.parameters(), strict=True))
    assert not loader.optimizer.state


@pytest.mark.parametrize("final", [True, False])
def test_a_save_whose_metadata_lacks_an_items_data_is_refused_and_not_committed(
    tmp_path, monkeypatch, final
):
    worker = _trained_worker()
    ck.save_checkpoint(worker, tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    monkeypatch.setattr(dcp, "unstored_items", lambda metadata: [STEP])
    worker.model(torch.ones(1, 256)).sum().backward()
    worker.optimizer.step()
    with pytest.raises(ck.CheckpointError, match=r"without their data; nothing was committed"):
        ck.save_checkpoint(worker, tmp_path / "w", tmp_path / "o", is_final_checkpoint=final)
        ck.finalize_async_save(worker)
    monkeypatch.undo()
    loader = child.SimpleWorker(child.build_model(seed=1))
    ck.load_checkpoint(loader, tmp_path / "w", tmp_path / "o")  # the first save, whole
    assert loader.optimizer.state

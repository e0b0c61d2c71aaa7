"""Digests of a checkpoint of ours are required: a missing file or entry is named, an edited
digests file is blamed itself, and `verify_digests=False` is the explicit way to skip them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from policyworker.shell import checkpoint as ck
from policyworker.shell.checkpoint import digests
from tests.shell.checkpoint import checkpoint_crash_child as child


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("digests")
    worker = child.SimpleWorker(child.build_model())
    worker.model(torch.ones(1, 256)).sum().backward()
    worker.optimizer.step()
    child.set_weights(worker.model, 3)
    ck.save_checkpoint(worker, root / "w", root / "o", is_final_checkpoint=True)
    return root


@pytest.fixture
def copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "c")
    return tmp_path / "c"


def _fresh():
    return child.SimpleWorker(child.build_model(seed=1))


def _weights(worker):
    return [p.detach().clone() for p in worker.model.parameters()]


def _unchanged(worker, before):
    return all(torch.equal(a, b) for a, b in zip(_weights(worker), before, strict=True))


@pytest.mark.parametrize("folder", ["w/model", "w/reference", "o/optim"])
def test_a_missing_digests_file_in_a_folder_of_ours_is_named_and_changes_nothing(copy, folder):
    record = copy / folder / digests.DIGESTS_FILE
    record.unlink()
    worker = _fresh()
    before = _weights(worker)
    with pytest.raises(ck.CheckpointError, match=rf"{record}' does not exist.*verify_digests"):
        ck.load_checkpoint(worker, copy / "w", copy / "o")
    assert _unchanged(worker, before)


def test_a_digests_file_lacking_an_entry_names_the_file_and_the_entries(copy):
    record = copy / "w" / "model" / digests.DIGESTS_FILE
    body = json.loads(record.read_text())
    dropped = sorted(body["files"])[-1]
    del body["files"][dropped]
    body["files_digest"] = digests._list_digest(body["files"])  # a consistent, shorter list
    record.write_text(json.dumps(body))
    with pytest.raises(
        ck.CheckpointError, match=rf"{record}' has no digest entry for \['{dropped}"
    ):
        ck.load_checkpoint(_fresh(), copy / "w", copy / "o")


def test_an_edited_digest_entry_blames_the_digests_file_not_the_healthy_file(copy):
    record = copy / "w" / "model" / digests.DIGESTS_FILE
    body = json.loads(record.read_text())
    body["files"][ck.MANIFEST_FILE]["digest"] = "0" * 64
    record.write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(_fresh(), copy / "w", copy / "o")
    assert f"{record}' was edited" in str(err.value)
    assert f"{ck.MANIFEST_FILE}' does not match" not in str(err.value)


def test_verify_digests_false_loads_a_folder_without_them(copy):
    for record in copy.rglob(digests.DIGESTS_FILE):
        record.unlink()
    worker = _fresh()
    ck.load_checkpoint(worker, copy / "w", copy / "o", verify_digests=False)
    assert all(
        torch.equal(p, torch.full_like(p, child.fill_value(3))) for p in worker.model.parameters()
    )


def test_a_folder_of_another_tool_without_digests_loads_unchecked(copy):
    model = copy / "w" / "model"
    for name in (digests.DIGESTS_FILE, ck.MANIFEST_FILE):
        (model / name).unlink()
    assert not digests.written_by_us(model)
    worker = _fresh()
    ck.load_checkpoint(worker, model)
    assert all(
        torch.equal(p, torch.full_like(p, child.fill_value(3))) for p in worker.model.parameters()
    )


def test_the_policy_worker_names_the_edited_digests_file_not_config_json(
    tiny_model_paths, tmp_path
):
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_config

    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    worker.save_checkpoint(tmp_path / "w", is_final_checkpoint=True)
    record = tmp_path / "w" / "model" / digests.DIGESTS_FILE
    body = json.loads(record.read_text())
    body["files"]["config.json"]["digest"] = "0" * 64
    record.write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError, match=rf"{record}' was edited") as err:
        worker.load_checkpoint(tmp_path / "w")
    assert "config.json' does not match" not in str(err.value)

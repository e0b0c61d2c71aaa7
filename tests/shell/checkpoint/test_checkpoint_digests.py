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


@pytest.mark.parametrize("algorithm", ["sha256-tree-64MiB", "blake3-tree-64MiB"])
def test_folders_digested_with_either_algorithm_load_and_a_flipped_byte_is_named(copy, algorithm):
    """Folders saved with SHA-256 (before BLAKE3 was used) keep verifying; both catch a flip."""
    for folder in ("w/model", "w/reference", "o/optim"):
        digests.write_digests(copy / folder, algorithm=algorithm)
        assert json.loads((copy / folder / digests.DIGESTS_FILE).read_text())["algorithm"] == (
            algorithm
        )
    ck.load_checkpoint(_fresh(), copy / "w", copy / "o")
    shard = sorted((copy / "w" / "model").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=rf"{shard}' does not match the digest"):
        ck.load_checkpoint(_fresh(), copy / "w", copy / "o")


def test_a_save_records_blake3_where_it_is_installed(saved):
    """vLLM brings blake3; the test environment has it, so a save here uses the faster hash."""
    body = json.loads((saved / "w" / "model" / digests.DIGESTS_FILE).read_text())
    assert body["algorithm"] == digests.save_algorithm() == "blake3-tree-64MiB"


def test_an_unknown_digest_algorithm_is_named(copy):
    record = copy / "w" / "model" / digests.DIGESTS_FILE
    body = json.loads(record.read_text())
    body["algorithm"] = "md5"
    record.write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError, match=r"uses digest 'md5'; expected sha256"):
        ck.load_checkpoint(_fresh(), copy / "w", copy / "o")


def _saved_while_written(tmp_path, monkeypatch, algorithm):
    """A sync and an async save; the files the commits read back to hash them (the others were
    hashed by the writer threads as they wrote them)."""
    read_back: list[str] = []
    second_pass = digests._digests_of

    def recording(paths, algo):
        read_back.extend(f"{p.parent.name}/{p.name}" for p in paths)
        return second_pass(paths, algo)

    monkeypatch.setattr(digests, "_digests_of", recording)
    monkeypatch.setattr(digests, "save_algorithm", lambda: algorithm)
    worker = child.SimpleWorker(child.build_model())
    worker.model(torch.ones(1, 256)).sum().backward()
    worker.optimizer.step()
    ck.save_checkpoint(worker, tmp_path / "sync", tmp_path / "sync", is_final_checkpoint=True)
    ck.save_checkpoint(worker, tmp_path / "async", tmp_path / "async")
    ck.finalize_async_save(worker)
    monkeypatch.undo()
    return read_back


@pytest.mark.parametrize("algorithm", ["sha256-tree-64MiB", "blake3-tree-64MiB"])
@pytest.mark.parametrize("piece_bytes", [64 * 2**20, 4096], ids=["64MiB", "4KiB"])
def test_digests_hashed_while_written_equal_a_second_pass_bit_for_bit(
    tmp_path, monkeypatch, algorithm, piece_bytes
):
    """4 KiB pieces: runs, headers and DCP items cross piece boundaries (1 MiB of weights)."""
    monkeypatch.setattr(digests, "_PIECE_BYTES", piece_bytes)
    read_back = _saved_while_written(tmp_path, monkeypatch, algorithm)
    monkeypatch.setattr(digests, "_PIECE_BYTES", piece_bytes)
    # the weights and the optimizer's data files were hashed by their writers, not read back (a
    # reference folder hard-linked from the previous save was not written: it is read back)
    written = [n for n in read_back if n.startswith(("model", "optim"))]  # their .tmp- folders
    assert not [n for n in written if n.endswith((".safetensors", ".distcp"))], read_back
    assert any(n.endswith(".json") for n in written)  # small files written another way are
    for save in ("sync", "async"):
        for folder in (tmp_path / save / "model", tmp_path / save / "optim"):
            body = json.loads((folder / digests.DIGESTS_FILE).read_text())
            assert body["algorithm"] == algorithm
            names = sorted(body["files"])
            again = digests._file_digests(folder, names, algorithm)  # a second pass
            assert {n: body["files"][n]["digest"] for n in names} == again
            assert any(n.endswith((".safetensors", ".distcp")) for n in names)


def test_a_byte_flipped_after_a_save_hashed_while_written_is_refused_at_load(tmp_path, monkeypatch):
    _saved_while_written(tmp_path, monkeypatch, digests.save_algorithm())
    ck.load_checkpoint(_fresh(), tmp_path / "sync", tmp_path / "sync")
    for pattern in ("model/*.safetensors", "optim/*.distcp"):
        shard = sorted((tmp_path / "sync").glob(pattern))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
        with pytest.raises(ck.CheckpointError, match=rf"{shard}' does not match the digest"):
            ck.load_checkpoint(_fresh(), tmp_path / "sync", tmp_path / "sync")
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))


def test_a_file_rewritten_after_it_was_hashed_is_read_back_not_trusted(tmp_path):
    """A noted digest counts only while the file is the one hashed (same inode, size, mtime)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 100)
    hasher = digests.TreeHasher(digests.save_algorithm())
    hasher.update(b"a" * 100)
    digests.record_written(path, hasher.hexdigest(), hasher=hasher, size=hasher.size)
    path.unlink()
    path.write_bytes(b"b" * 100)  # another file of the same size in its place
    digests.write_digests(tmp_path)
    body = json.loads((tmp_path / digests.DIGESTS_FILE).read_text())
    assert (
        body["files"]["f.bin"]["digest"]
        == digests._file_digests(tmp_path, ["f.bin"], body["algorithm"])["f.bin"]
    )
    assert body["files"]["f.bin"]["digest"] != hasher.hexdigest()

"""Sync saves copy device state out while they write; loads check digests while they read.

A sync save writes the same weight bytes and optimizer state as an async save of the same state,
also when its runs go through the writers' bounce buffers in chunks smaller than one run; the
folders of a save are written side by side. A load reads weight files on several threads, commits
nothing before its concurrent digest checks finished, and a digest failure wins over the read
error it caused.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import threading
import time

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell import checkpoint as ck
from policyworker.shell.checkpoint import bounce, digests, safetensors_io, safetensors_load
from policyworker.shell.checkpoint.layout import CheckpointError
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.helpers import (
    assert_same_checkpoint_state,
    checkpoint_state,
    optimizer_tensor_bytes,
    safetensors_shards,
)
from tests.shell.conftest import make_batch, make_config


def _trained(path):
    worker = PolicyWorker(make_config(path), init_reference_model=False)
    assert worker.train(make_batch(4, 10, seed=7), NLLLoss())["skipped_steps"] == 0
    return worker


def _async_then_sync(worker, root: pathlib.Path) -> None:
    ck.save_checkpoint(worker.state, root / "async", root / "async")
    ck.finalize_async_save(worker.state)
    ck.save_checkpoint(worker.state, root / "sync", root / "sync", is_final_checkpoint=True)


def _assert_saves_match(path, root: pathlib.Path) -> None:
    shards = safetensors_shards(root / "async")
    assert shards and safetensors_shards(root / "sync") == shards
    loaded = []
    for name in ("async", "sync"):
        fresh = PolicyWorker(make_config(path), init_reference_model=False)
        ck.load_checkpoint(fresh.state, root / name, root / name)
        loaded.append(checkpoint_state(fresh))
    assert_same_checkpoint_state(*loaded)


def test_a_sync_save_writes_what_an_async_save_of_the_same_state_writes(tiny_model_paths, tmp_path):
    path = tiny_model_paths["llama"]
    worker = _trained(path)
    _async_then_sync(worker, tmp_path)
    _assert_saves_match(path, tmp_path)
    assert_same_checkpoint_state(
        checkpoint_state(worker), checkpoint_state(_loaded(path, tmp_path / "sync"))
    )


def _loaded(path, folder):
    fresh = PolicyWorker(make_config(path), init_reference_model=False)
    ck.load_checkpoint(fresh.state, folder, folder)
    return fresh


def test_bounce_buffer_chunks_smaller_than_a_run_write_the_same_bytes(
    tiny_model_paths, tmp_path, monkeypatch
):
    """On the CPU, data goes through the bounce path only when told to (`bounced`): then every
    weight byte and every optimizer tensor byte (DCP's writer threads, through the save planner)
    is copied out, and a chunk size that is no multiple of any itemsize splits elements across
    chunks."""
    path = tiny_model_paths["llama"]
    worker = _trained(path)
    chunk = 1001
    copied: list[int] = []
    copy_out = bounce.Bounce.copy_out

    def counting(self, src, ready):
        assert src.dtype == torch.uint8 and src.numel() <= chunk
        copied.append(src.numel())
        return copy_out(self, src, ready)

    ck.save_checkpoint(worker.state, tmp_path / "async", tmp_path / "async")
    ck.finalize_async_save(worker.state)
    monkeypatch.setattr(bounce, "BOUNCE_BYTES", chunk)
    monkeypatch.setattr(bounce, "bounced", lambda tensor: True)
    monkeypatch.setattr(bounce.Bounce, "copy_out", counting)
    ck.save_checkpoint(worker.state, tmp_path / "sync", tmp_path / "sync", is_final_checkpoint=True)
    monkeypatch.undo()
    header_bytes = sum(
        8 + int.from_bytes(blob[:8], "little")
        for blob in safetensors_shards(tmp_path / "sync").values()
    )
    data_bytes = (
        sum(len(blob) for blob in safetensors_shards(tmp_path / "sync").values()) - header_bytes
    )
    optimizer_bytes = optimizer_tensor_bytes(worker.optimizer)
    assert optimizer_bytes > 0 and sum(copied) == data_bytes + optimizer_bytes
    assert max(copied) == chunk
    assert len(copied) > len(worker.model.state_dict())  # runs were split, not copied whole
    _assert_saves_match(path, tmp_path)


def test_a_load_commits_only_after_its_concurrent_digest_checks_passed(
    tiny_model_paths, tmp_path, monkeypatch
):
    path = tiny_model_paths["llama"]
    _trained(path).save_checkpoint(tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    worker = _trained(path)
    before = checkpoint_state(worker)
    seen = []
    verify = digests.verify_digests

    def slow_failing(folder):
        verify(folder)
        time.sleep(0.3)  # the reads finish first: only the commits are left waiting
        seen.append((threading.current_thread().name, _unchanged(worker, before)))
        if pathlib.Path(folder).name == "optim":
            msg = f"checkpoint file {str(folder)!r} planted digest failure"
            raise CheckpointError(msg)

    monkeypatch.setattr(digests, "verify_digests", slow_failing)
    with pytest.raises(CheckpointError, match="planted digest failure"):
        worker.load_checkpoint(tmp_path / "w", tmp_path / "o")
    assert len(seen) == 2 and all(unchanged for _, unchanged in seen)
    assert all(name.startswith("checkpoint-verify") for name, _ in seen)
    assert_same_checkpoint_state(checkpoint_state(worker), before)


def _unchanged(worker, before) -> bool:
    weights = worker.model.state_dict()
    return all(torch.equal(weights[k], v) for k, v in before[0].items())


def test_a_read_that_fails_on_a_corrupted_file_raises_the_digest_error(tiny_model_paths, tmp_path):
    """An edited safetensors header makes the reader fail too; the digest error names the file
    and says its bytes changed, which is the cause."""
    path = tiny_model_paths["llama"]
    _trained(path).save_checkpoint(tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    shard = max((tmp_path / "w" / "model").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    header.pop(next(k for k in header if k != "__metadata__"))  # the reader misses a tensor
    raw[8 : 8 + size] = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    shard.write_bytes(bytes(raw))
    worker = _trained(path)
    before = checkpoint_state(worker)
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patch:
        patch.setattr(digests, "verify_digests", lambda folder: None)
        with pytest.raises(CheckpointError) as read_error:
            worker.load_checkpoint(tmp_path / "w", tmp_path / "o")
    assert "does not match the digest" not in str(read_error.value)  # the reader fails alone
    with pytest.raises(CheckpointError, match=rf"{shard}' does not match the digest"):
        worker.load_checkpoint(tmp_path / "w", tmp_path / "o")
    assert_same_checkpoint_state(checkpoint_state(worker), before)


def test_the_folders_of_a_save_are_written_side_by_side_and_the_first_jobs_error_wins():
    """Jobs that each wait for all the others finish only when they run at once; a failure is
    raised after every job ended, the first job's when several fail."""
    from policyworker.shell.checkpoint.saver import run_jobs_concurrently

    ended = []

    def job(name, all_running, error=None):
        def run():
            all_running.wait()
            time.sleep(0.05 if error is None else 0)  # the failing jobs end first
            ended.append(name)
            if error is not None:
                raise error

        return run

    two = threading.Barrier(2, timeout=10)
    run_jobs_concurrently([job("weights", two), job("optimizer", two)])
    assert sorted(ended) == ["optimizer", "weights"]
    ended.clear()
    three = threading.Barrier(3, timeout=10)
    jobs = [
        job("weights", three, OSError("disk full (weights)")),
        job("reference", three),
        job("optimizer", three, OSError("disk full (optimizer)")),
    ]
    with pytest.raises(OSError, match=r"\(weights\)"):
        run_jobs_concurrently(jobs)
    assert sorted(ended) == ["optimizer", "reference", "weights"]


def test_a_load_reads_several_weight_files_on_several_threads_into_the_same_state(
    tiny_model_paths, tmp_path, monkeypatch
):
    import safetensors

    path = tiny_model_paths["llama"]
    worker = _trained(path)
    total = sum(t.nbytes for t in worker.model.state_dict().values())
    job = safetensors_io.save_hf_weights(
        worker.model, tmp_path / "model", parallel=worker.state.parallel, max_file_bytes=total // 4
    )
    job()
    files = sorted((tmp_path / "model").glob("*.safetensors"))
    assert len(files) >= 3
    readers: dict[str, set[str]] = {}
    safe_open = safetensors.safe_open

    def recording(file, *args, **kwargs):
        readers.setdefault(threading.current_thread().name, set()).add(pathlib.Path(file).name)
        time.sleep(0.05)  # every file is opened before the first read ends
        return safe_open(file, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording)
    fresh = PolicyWorker(make_config(path), init_reference_model=False)
    commit = safetensors_load.load_hf_weights(
        fresh.model, tmp_path / "model", parallel=fresh.state.parallel
    )
    commit()
    assert len(readers) >= 2 and all(n.startswith("checkpoint-read") for n in readers)
    assert set().union(*readers.values()) == {f.name for f in files}
    want, got = worker.model.state_dict(), fresh.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_the_writer_threads_take_the_weight_files_in_turn_and_the_files_load_back(
    tiny_model_paths, tmp_path, monkeypatch
):
    """Each queued task (one digest piece of a file, written front to back) belongs to another
    file than the one before it while files are left, so threads write several files at once
    (one file's writes take turns on its inode lock)."""
    from policyworker.shell.checkpoint import digests, layout

    path = tiny_model_paths["llama"]
    worker = _trained(path)
    total = sum(t.nbytes for t in worker.model.state_dict().values())
    monkeypatch.setattr(layout, "WRITER_THREADS", 1)  # one thread: writes land in queue order
    monkeypatch.setattr(digests, "_PIECE_BYTES", 4096)  # several pieces (tasks) per file
    order: list[int] = []
    pwrite_all = safetensors_io._pwrite_all

    def recording(fd, data, offset):
        order.append(fd)
        pwrite_all(fd, data, offset)

    monkeypatch.setattr(safetensors_io, "_pwrite_all", recording)
    job = safetensors_io.save_hf_weights(
        worker.model, tmp_path / "model", parallel=worker.state.parallel, max_file_bytes=total // 3
    )
    job()
    files = len(list((tmp_path / "model").glob("*.safetensors")))
    assert files >= 3 and len(set(order)) == files
    turns = [fd for fd, _ in itertools.groupby(order)]  # a task's writes, one after another
    assert turns[:files] == sorted(set(order), key=order.index)  # the first turn: every file
    assert len(turns) >= 2 * files, turns  # in file order there would be `files` turns
    fresh = PolicyWorker(make_config(path), init_reference_model=False)
    safetensors_load.load_hf_weights(
        fresh.model, tmp_path / "model", parallel=fresh.state.parallel
    )()
    want, got = worker.model.state_dict(), fresh.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_save_spreads_large_weights_over_several_files_and_keeps_a_tiny_model_in_one(
    tiny_model_paths, tmp_path, monkeypatch
):
    from policyworker.functional import safetensors_layout

    path = tiny_model_paths["llama"]
    worker = _trained(path)
    total = sum(t.nbytes for t in worker.model.state_dict().values())
    safetensors_io.save_hf_weights(
        worker.model, tmp_path / "tiny", parallel=worker.state.parallel
    )()
    assert len(list((tmp_path / "tiny").glob("*.safetensors"))) == 1
    # the same model as if its weights were past 8 x the smallest split file
    monkeypatch.setattr(
        safetensors_io,
        "file_bytes_for_parallel_writes",
        lambda n: safetensors_layout.file_bytes_for_parallel_writes(n, min_file_bytes=total // 16),
    )
    safetensors_io.save_hf_weights(worker.model, tmp_path / "big", parallel=worker.state.parallel)()
    assert len(list((tmp_path / "big").glob("*.safetensors"))) >= safetensors_layout.WRITE_STREAMS


def test_an_optimizer_load_reads_its_dcp_files_on_several_threads_into_the_same_state(
    tiny_model_paths, tmp_path, monkeypatch
):
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from policyworker.shell.checkpoint import layout

    path = tiny_model_paths["llama"]
    monkeypatch.setattr(layout, "WRITER_THREADS", 4)  # the save writes one file per thread
    worker = _trained(path)
    worker.save_checkpoint(tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    files = sorted((tmp_path / "o" / "optim").glob("*.distcp"))
    assert len(files) >= 2
    readers: dict[str, int] = {}
    read_data = FileSystemReader.read_data

    def recording(self, plan, planner):
        name = threading.current_thread().name
        readers[name] = readers.get(name, 0) + 1
        time.sleep(0.05)  # every file's read starts before the first one ends
        return read_data(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    fresh = PolicyWorker(make_config(path), init_reference_model=False)
    ck.load_checkpoint(fresh.state, tmp_path / "w", tmp_path / "o")
    assert len([n for n in readers if n.startswith("checkpoint-read")]) >= 2
    assert_same_checkpoint_state(checkpoint_state(fresh), checkpoint_state(worker))

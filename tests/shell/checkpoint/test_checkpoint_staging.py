"""Async saves stage into CPU buffers that the saver keeps and reuses (pinned when CUDA exists).

Two consecutive async saves reuse the same buffers; training right after a save returns does not
reach the files; shutdown frees the buffers; a sync save keeps none, and reuses those an async
save made.
"""

from __future__ import annotations

import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell import checkpoint as ck
from policyworker.shell.checkpoint.saver import StagingBuffers
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config


def _train(worker, seed):
    assert worker.train(make_batch(4, 10, seed=seed), NLLLoss())["skipped_steps"] == 0


def _training_state(worker):
    weights = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    optim = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in worker.optimizer.state_dict()["state"].items()
    }
    return weights, optim


def _assert_equal_state(got, want):
    (gw, go), (ww, wo) = got, want
    assert gw.keys() == ww.keys() and all(torch.equal(gw[k], ww[k]) for k in ww)
    assert go.keys() == wo.keys()
    for i, state in wo.items():
        assert go[i].keys() == state.keys()
        assert all(torch.equal(go[i][k], v) for k, v in state.items())


def test_two_async_saves_reuse_the_same_buffers_and_training_after_a_save_misses_it(
    tiny_model_paths, tmp_path
):
    path, worker, first = _worker_after_an_async_save(tiny_model_paths, tmp_path / "a")
    staging = worker.state.saver.staging
    assert all(first.values()) and staging.nbytes > 0
    ck.finalize_async_save(worker.state)
    _train(worker, 1)
    before = _training_state(worker)
    ck.save_checkpoint(worker.state, tmp_path / "b", tmp_path / "b")
    for group, views in first.items():
        again = staging.views(group)
        assert len(again) == len(views) and all(a is b for a, b in zip(again, views, strict=True))
    _train(worker, 2)  # the optimizer step changes every tensor the save staged
    ck.finalize_async_save(worker.state)
    assert not _equal_weights(_training_state(worker)[0], before[0])
    _assert_loads_back(path, tmp_path / "b", before)


def _worker_after_an_async_save(tiny_model_paths, folder):
    """A trained worker, its model path, and the staged views of its first (async) save."""
    path = tiny_model_paths["llama"]
    worker = PolicyWorker(make_config(path), init_reference_model=False)
    _train(worker, 0)
    ck.save_checkpoint(worker.state, folder, folder)
    staging = worker.state.saver.staging
    return path, worker, {g: staging.views(g) for g in ("weights", "optimizer")}


def _assert_loads_back(path, folder, state):
    fresh = PolicyWorker(make_config(path), init_reference_model=False)
    ck.load_checkpoint(fresh.state, folder, folder)
    _assert_equal_state(_training_state(fresh), state)


def _equal_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in b)


def test_shutdown_frees_the_staging_buffers(tiny_model_paths, tmp_path):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    _train(worker, 0)
    ck.save_checkpoint(worker.state, tmp_path / "w", tmp_path / "o")
    assert worker.state.saver.staging.nbytes > 0
    worker.shutdown()
    assert worker.state.saver.staging.nbytes == 0
    assert worker.state.saver.staging.views("weights") == []
    assert (tmp_path / "w" / "model" / ck.INDEX_FILE).is_file()  # the save was committed first


def test_a_sync_save_keeps_no_staging_buffers(tiny_model_paths, tmp_path):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    ck.save_checkpoint(worker.state, tmp_path / "w", is_final_checkpoint=True)
    assert worker.state.saver.staging.nbytes == 0


def test_a_sync_save_after_an_async_one_writes_through_its_buffers(
    tiny_model_paths, tmp_path, monkeypatch
):
    """The final save of a loop that saved asynchronously stages into the buffers that save
    made (no new ones) and writes the state of the moment it was called, committed on return."""
    path, worker, views = _worker_after_an_async_save(tiny_model_paths, tmp_path / "a")
    staging = worker.state.saver.staging
    nbytes = staging.nbytes
    _train(worker, 1)
    before = _training_state(worker)
    staged = []
    stage = staging.stage
    monkeypatch.setattr(
        staging, "stage", lambda group, items: [staged.append(group), stage(group, items)][1]
    )
    ck.save_checkpoint(worker.state, tmp_path / "b", tmp_path / "b", is_final_checkpoint=True)
    assert sorted(staged) == ["optimizer", "weights"] and staging.nbytes == nbytes
    for group, first in views.items():
        assert all(a is b for a, b in zip(staging.views(group), first, strict=True))
    _train(worker, 2)
    _assert_loads_back(path, tmp_path / "b", before)


def test_staging_reuses_a_group_while_its_layout_holds_and_reallocates_when_it_changes():
    staging = StagingBuffers()
    a, b = torch.randn(3, 5), torch.arange(8, dtype=torch.int64)
    first = staging.stage("g", [("a", a), ("b", b[::2])])  # a strided source is fine
    staging.wait()
    assert torch.equal(first[0], a) and torch.equal(first[1], b[::2])
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in first)
    assert staging.nbytes == 64 + 64  # 60 and 32 bytes, each rounded up to 64
    second = staging.stage("g", [("a", a + 1), ("b", b[1::2])])
    assert all(x is y for x, y in zip(first, second, strict=True))
    assert torch.equal(second[0], a + 1) and torch.equal(first[1], b[1::2])  # the same memory
    third = staging.stage("g", [("a", torch.zeros(4, 5))])
    assert third[0] is not first[0] and staging.nbytes == 128
    staging.release()
    assert staging.nbytes == 0 and staging.views("g") == []


def test_buffers_are_page_locked_once_and_unlocked_before_they_are_freed(monkeypatch):
    """With CUDA (faked here), each group's flat buffer is registered in place at allocation
    and unregistered exactly once when it is reallocated or released."""
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the CUDA runtime's name)
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    staging = StagingBuffers()
    first = staging.stage("g", [("a", torch.ones(16))])
    staging.stage("g", [("a", torch.ones(16))])  # reused: no second registration
    ptr = first[0].data_ptr()
    assert calls == [("register", ptr, 64)]
    staging.stage("g", [("a", torch.ones(32))])  # new layout: the old buffer is unlocked first
    assert calls[1] == ("unregister", ptr) and calls[2][0] == "register"
    staging.release()
    assert [c[0] for c in calls] == ["register", "unregister", "register", "unregister"]

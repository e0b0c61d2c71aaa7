"""Checkpoints: exact resume, HF loading, async completion, atomic replace, crash safety, errors."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing
import os
import pathlib
import random
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.loss import NLLLoss
from policyworker.functional.names import CheckpointPiece, whole_piece
from policyworker.functional.safetensors_layout import contiguous_runs
from policyworker.shell import checkpoint as ck
from policyworker.shell.checkpoint import api as ck_api
from policyworker.shell.checkpoint import commit as ck_commit
from policyworker.shell.checkpoint import load as ck_load
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.checkpoint import checkpoint_crash_child as child
from tests.shell.conftest import make_batch, make_config

SCHEDULER = {"name": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 1, "gamma": 0.7}}


def _cfg(path):
    return make_config(path, scheduler=SCHEDULER)


def _train(worker, steps):
    for step in steps:
        worker.train(make_batch(4, 10, seed=100 + step), NLLLoss())


def _weights(worker):
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def _assert_same_training_state(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, state in sa["state"].items():
        assert state.keys() == sb["state"][i].keys()
        assert all(torch.equal(v, sb["state"][i][k]) for k, v in state.items())
    assert a.scheduler.state_dict() == b.scheduler.state_dict()


def test_resume_at_step_k_then_continue_equals_uninterrupted_run(tiny_model_paths, tmp_path):
    """Save at step 2 (async), load into a fresh worker, train to step 4: bit-identical."""
    path = tiny_model_paths["llama"]
    straight = PolicyWorker(_cfg(path))
    _train(straight, range(4))
    first = PolicyWorker(_cfg(path))
    _train(first, range(2))
    ck.save_checkpoint(first.state, tmp_path / "weights", tmp_path / "optimizer")
    ck.finalize_async_save(first.state)
    resumed = PolicyWorker(_cfg(path))
    ck.load_checkpoint(resumed.state, tmp_path / "weights", tmp_path / "optimizer")
    _assert_same_training_state(resumed, first)
    _train(resumed, range(2, 4))
    _assert_same_training_state(resumed, straight)


def test_constructor_resume_keeps_the_original_reference(tiny_model_paths, tmp_path):
    """Built from the checkpoint folders, the constructor restores the ORIGINAL reference (not
    the resumed weights, as the reference system does) and the optimizer; training continues
    identically."""
    path = tiny_model_paths["qwen2"]
    first = PolicyWorker(_cfg(path))
    base_ref = {k: v.clone() for k, v in first._reference_state.items()}
    _train(first, range(2))
    assert not torch.equal(first.model.model.norm.weight, base_ref["model.norm.weight"])
    ck.save_checkpoint(first.state, tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    resumed = PolicyWorker(
        _cfg(path), weights_path=str(tmp_path / "w"), optimizer_path=str(tmp_path / "o")
    )
    assert all(torch.equal(resumed._reference_state[k], base_ref[k]) for k in base_ref)
    data = make_batch(4, 10, seed=5)
    torch.testing.assert_close(
        resumed.get_reference_policy_logprobs(data)["reference_logprobs"],
        PolicyWorker(_cfg(path)).get_logprobs(data)["logprobs"],
        rtol=0,
        atol=0,
    )
    _train(first, range(2, 3))
    _train(resumed, range(2, 3))
    _assert_same_training_state(resumed, first)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_from_pretrained_on_saved_folder_reproduces_worker_logits(tiny_model_paths, tmp_path, kind):
    import transformers

    worker = PolicyWorker(_cfg(tiny_model_paths[kind]))
    _train(worker, range(1))
    ck.save_checkpoint(worker.state, tmp_path / "w", is_final_checkpoint=True)
    folder = tmp_path / "w" / "model"
    assert {"config.json", "generation_config.json", ck.INDEX_FILE} <= set(os.listdir(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert next(hf.parameters()).dtype == torch.float32
    ids = make_batch(2, 9, seed=3, lengths=[9, 9])["input_ids"]
    worker.model.eval()
    with torch.no_grad():
        expected = worker.model(input_ids=ids).logits
        got = hf(input_ids=ids).logits
    assert torch.equal(got, expected)


def test_saved_tokenizer_loads(tiny_tokenizer_model_path, tmp_path):
    from transformers import AutoTokenizer

    worker = PolicyWorker(_cfg(tiny_tokenizer_model_path), init_reference_model=False)
    ck.save_checkpoint(worker.state, tmp_path / "w", tokenizer_path=tmp_path / "tok")
    ck.finalize_async_save(worker.state)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.get_vocab() == worker.tokenizer.get_vocab()
    assert tok("t5")["input_ids"] == worker.tokenizer("t5")["input_ids"] == [5]
    assert (tok.eos_token, tok.pad_token) == (
        worker.tokenizer.eos_token,
        worker.tokenizer.pad_token,
    )


def _tensor_hashes(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        out.update(
            {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in load_file(f).items()}
        )
    return out


def test_async_save_returns_after_staging_and_finalize_after_files_are_complete(
    tiny_model_paths, tmp_path
):
    worker = PolicyWorker(_cfg(tiny_model_paths["llama"]))
    _train(worker, range(1))
    staged = {
        k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in _weights(worker).items()
    }
    ck.save_checkpoint(worker.state, tmp_path / "w", tmp_path / "o")
    _train(worker, range(1, 2))  # training mutates the weights while the writer runs
    ck.finalize_async_save(worker.state)
    folder = tmp_path / "w" / "model"
    for file, entry in ck.validate_hf_folder(folder).values():  # sizes match every header
        assert file.stat().st_size >= entry["data_offsets"][1]
    assert _tensor_hashes(folder) == staged
    assert sorted(os.listdir(tmp_path)) == ["o", "w"]
    assert sorted(os.listdir(tmp_path / "w")) == ["model", "reference"]
    assert (tmp_path / "o" / "optim" / ".metadata").is_file()


def test_save_before_finalize_leaves_no_final_folder_and_next_save_finalizes(
    tiny_model_paths, tmp_path
):
    worker = PolicyWorker(_cfg(tiny_model_paths["llama"]))
    ck.save_checkpoint(worker.state, tmp_path / "a")
    worker.state.saver._thread.join()
    assert not (tmp_path / "a" / "model").exists()  # written, not yet renamed into place
    assert any(p.name.startswith("model.tmp-") for p in (tmp_path / "a").iterdir())
    ck.save_checkpoint(worker.state, tmp_path / "b")
    assert (tmp_path / "a" / "model" / ck.INDEX_FILE).is_file()
    ck.finalize_async_save(worker.state)
    assert sorted(os.listdir(tmp_path / "a")) == ["model", "reference"]


def test_replacing_a_checkpoint_swaps_it_and_unchanged_reference_is_hard_linked(
    tiny_model_paths, tmp_path
):
    worker = PolicyWorker(_cfg(tiny_model_paths["llama"]))
    ck.save_checkpoint(worker.state, tmp_path / "s1", is_final_checkpoint=True)
    ck.save_checkpoint(worker.state, tmp_path / "s", is_final_checkpoint=True)
    _train(worker, range(1))
    ck.save_checkpoint(worker.state, tmp_path / "s", is_final_checkpoint=True)
    assert _tensor_hashes(tmp_path / "s" / "model") == {
        k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in _weights(worker).items()
    }
    ref_files = sorted((tmp_path / "s1" / "reference").glob("*.safetensors"))
    assert ref_files and all(
        f.stat().st_ino == (tmp_path / "s" / "reference" / f.name).stat().st_ino for f in ref_files
    )
    assert sorted(os.listdir(tmp_path / "s")) == ["model", "reference"]


def _corrupt_then_expect(tiny_model_paths, tmp_path, corrupt, match):
    path = tiny_model_paths["llama"]
    worker = PolicyWorker(_cfg(path))
    _train(worker, range(1))
    ck.save_checkpoint(worker.state, tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    corrupt(tmp_path)
    fresh = PolicyWorker(_cfg(path))
    before, opt_before = _weights(fresh), fresh.optimizer.state_dict()
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load_checkpoint(fresh.state, tmp_path / "w", tmp_path / "o")
    after = _weights(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert fresh.optimizer.state_dict()["state"] == opt_before["state"] == {}


def _truncate(path, keep=0.5):
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(int(size * keep))


def test_missing_weights_file_is_named_and_model_unchanged(tiny_model_paths, tmp_path):
    def corrupt(root):
        (root / "w" / "model" / "model-00001-of-00001.safetensors").unlink()

    _corrupt_then_expect(
        tiny_model_paths, tmp_path, corrupt, r"model-00001-of-00001\.safetensors' does not exist"
    )


def test_truncated_weights_file_is_named_and_model_unchanged(tiny_model_paths, tmp_path):
    def corrupt(root):
        _truncate(root / "w" / "model" / "model-00001-of-00001.safetensors")

    _corrupt_then_expect(
        tiny_model_paths, tmp_path, corrupt, r"model-00001-of-00001\.safetensors.*truncated"
    )


def test_truncated_optimizer_shard_is_named_and_state_unchanged(tiny_model_paths, tmp_path):
    def corrupt(root):
        _truncate(root / "o" / "optim" / "__0_0.distcp")

    _corrupt_then_expect(tiny_model_paths, tmp_path, corrupt, r"__0_0\.distcp.*truncated")


def test_weights_and_optimizer_of_different_saves_are_rejected(tiny_model_paths, tmp_path):
    worker = PolicyWorker(_cfg(tiny_model_paths["llama"]))
    ck.save_checkpoint(worker.state, tmp_path / "w1", tmp_path / "o1", is_final_checkpoint=True)
    ck.save_checkpoint(worker.state, tmp_path / "w2", tmp_path / "o2", is_final_checkpoint=True)
    with pytest.raises(ck.CheckpointError, match="different saves"):
        ck.load_checkpoint(
            PolicyWorker(_cfg(tiny_model_paths["llama"])).state, tmp_path / "w1", tmp_path / "o2"
        )


def test_missing_checkpoint_folder_error_names_it(tiny_model_paths, tmp_path):
    worker = PolicyWorker(_cfg(tiny_model_paths["llama"]))
    with pytest.raises(ck.CheckpointError, match="no checkpoint at"):
        ck.load_checkpoint(worker.state, tmp_path / "nothing")
    with pytest.raises(ValueError, match="no tokenizer"):
        ck.save_checkpoint(worker.state, tmp_path / "w", tokenizer_path=tmp_path / "t")
    assert not (tmp_path / "w").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_format_detection_and_dcp_weights_load(tiny_model_paths, tmp_path):
    import torch.distributed.checkpoint as dcp

    worker = PolicyWorker(_cfg(tiny_model_paths["llama"]))
    _train(worker, range(1))
    dcp.save(
        _weights(worker),
        storage_writer=dcp.FileSystemWriter(str(tmp_path / "d" / "model")),
        no_dist=True,
    )
    assert ck.detect_weights_format(tmp_path / "d") == "dcp"
    ck.save_checkpoint(worker.state, tmp_path / "h", is_final_checkpoint=True)
    assert (
        ck.detect_weights_format(tmp_path / "h")
        == ck.detect_weights_format(tmp_path / "h" / "model")
        == "safetensors"
    )
    assert ck.detect_weights_format(tiny_model_paths["llama"]) == "safetensors"
    fresh = PolicyWorker(_cfg(tiny_model_paths["llama"]))
    ck.load_checkpoint(fresh.state, tmp_path / "d")
    assert all(
        torch.equal(a, b)
        for a, b in zip(_weights(fresh).values(), _weights(worker).values(), strict=True)
    )


def test_lora_run_saves_and_loads_a_peft_adapter(tiny_model_paths, tmp_path):
    from policyworker.shell.model.lora import apply_lora, lora_state_dict

    def lora_worker():
        model = child.build_model()
        worker = child.SimpleWorker(model)
        apply_lora(model, {"target_modules": ["0", "2"], "dim": 4, "alpha": 8})
        worker.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-2
        )
        worker.scheduler = None
        return worker

    worker = lora_worker()
    worker.model(torch.ones(2, 256)).sum().backward()
    worker.optimizer.step()
    ck.save_checkpoint(worker, tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    assert ck.detect_weights_format(tmp_path / "w") == "peft"
    fresh = lora_worker()
    ck.load_checkpoint(fresh, tmp_path / "w", tmp_path / "o")
    a, b = lora_state_dict(worker.model), lora_state_dict(fresh.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = worker.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


def _fork(target, *args):
    proc = multiprocessing.get_context("fork").Process(target=target, args=args)
    proc.start()
    return proc


def _kill_when(proc, marker, delay_s=0.0):
    deadline = time.monotonic() + 60
    while not pathlib.Path(marker).exists():
        assert proc.is_alive() and time.monotonic() < deadline, "crash child never got there"
        time.sleep(0.005)
    time.sleep(delay_s)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def _records(folder):
    return sorted(p.name for p in folder.glob(f"{ck.COMMIT_RECORD_PREFIX}*.json"))


def _load_and_check_save(root):
    """Load root's checkpoint: a complete save `i` (weights, optimizer, scheduler, reference)."""
    worker = child.SimpleWorker(child.build_model(seed=1))
    ck.load_checkpoint(worker, root / "weights", root / "optimizer")
    i = round(float(next(worker.model.parameters()).detach().flatten()[0])) - 1
    assert all(
        torch.equal(p, torch.full_like(p, child.fill_value(i))) for p in worker.model.parameters()
    )
    assert worker.scheduler.state_dict()["last_epoch"] == i + 1  # the optimizer of the same save
    ref = child.build_model()
    assert all(torch.equal(worker._reference_state[k], v) for k, v in ref.state_dict().items())
    assert not _records(root / "weights") and not _records(root / "optimizer")
    return i


def test_sigkill_during_save_leaves_previous_checkpoint_complete(tmp_path):
    """Killed at a random moment (10 times; the child sleeps after each folder rename, so kills
    often land between two renames), the checkpoint loads as one complete save."""
    rng = random.Random(0)
    phases = []
    for attempt in range(10):
        root = tmp_path / f"run{attempt}"
        marker = tmp_path / f"ready{attempt}"
        proc = _fork(child.run, str(root), str(marker), 0.03)
        _kill_when(proc, marker, rng.uniform(0.0, 0.3))
        names = set(os.listdir(root / "weights"))
        phases.append(
            "commit" if _records(root / "weights") else "write" if len(names) > 2 else "idle"
        )
        assert {"model", "reference"} <= names
        _load_and_check_save(root)
        assert {"model", "reference"} <= set(os.listdir(root / "weights")) <= names
    assert set(phases) - {"idle"}, phases  # some kills landed inside a save


@pytest.mark.parametrize("stop_in_save", [0, 1], ids=["first-save", "replacing"])
def test_sigkill_between_renames_and_during_recovery_rolls_the_save_forward(tmp_path, stop_in_save):
    """Killed right after a save's first folder rename (weights of save k beside the optimizer
    of save k-1), then killed again after the first rename of the recovery inside a load: the
    next load still finishes save k, and no leftover stays."""
    root = tmp_path / "run"
    proc = _fork(
        child.run, str(root), str(tmp_path / "ready"), 0.0, stop_in_save, str(tmp_path / "stop1")
    )
    _kill_when(proc, tmp_path / "stop1")
    [record] = _records(root / "weights")
    token = record.removeprefix(ck.COMMIT_RECORD_PREFIX).removesuffix(".json")
    assert _records(root / "optimizer") == [record]
    assert ck_load._manifest_id(root / "weights" / "model") == token  # renamed
    assert (root / "optimizer" / f"optim.tmp-{token}").is_dir()  # not yet renamed
    assert (root / "weights" / f"reference.tmp-{token}").is_dir()

    proc = _fork(child.load_until_first_rename, str(root), str(tmp_path / "stop2"))
    _kill_when(proc, tmp_path / "stop2")
    assert not (root / "optimizer" / f"optim.tmp-{token}").exists()  # recovery renamed it
    assert (root / "weights" / f"reference.tmp-{token}").is_dir()
    assert _records(root / "weights") == [record]

    assert _load_and_check_save(root) == stop_in_save
    assert sorted(os.listdir(root / "weights")) == ["model", "reference"]
    assert sorted(os.listdir(root / "optimizer")) == ["optim"]


def test_next_save_recovers_a_killed_commit_before_it_clears_leftovers(tmp_path, monkeypatch):
    root = tmp_path / "run"
    proc = _fork(child.run, str(root), str(tmp_path / "ready"), 0.0, 1, str(tmp_path / "stop"))
    _kill_when(proc, tmp_path / "stop")
    assert _records(root / "weights")
    seen = []
    clear = ck_commit._clear_stale

    def spy(final):
        saved_id = ck_load._manifest_id(root / "weights/model")
        seen.append((final.name, _records(final.parent), saved_id))
        clear(final)

    monkeypatch.setattr(ck_api, "_clear_stale", spy)
    worker = child.SimpleWorker(child.build_model())
    worker.model(torch.ones(1, 256)).sum().backward()
    worker.optimizer.step()
    for _ in range(7):
        worker.scheduler.step()
    child.set_weights(worker.model, 6)
    ck.save_checkpoint(worker, root / "weights", root / "optimizer", is_final_checkpoint=True)
    assert [name for name, _, _ in seen] == ["model", "optim", "reference"]
    assert all(records == [] for _, records, _ in seen)  # recovered first
    assert len({checkpoint_id for _, _, checkpoint_id in seen}) == 1
    assert _load_and_check_save(root) == 6


class _Crash(BaseException):
    """A simulated SIGKILL: raised instead of the n-th file operation."""


def _crash_at(monkeypatch, n):
    """Make the n-th rename / exchange / rmtree / unlink from now on raise `_Crash`."""
    count = [0]

    def counted(fn):
        def wrapper(*args, **kwargs):
            count[0] += 1
            if count[0] == n:
                raise _Crash
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(os, "rename", counted(os.rename))
    monkeypatch.setattr(ck_commit, "_exchange", counted(ck_commit._exchange))
    monkeypatch.setattr(ck_commit.shutil, "rmtree", counted(ck_commit.shutil.rmtree))
    monkeypatch.setattr(pathlib.Path, "unlink", counted(pathlib.Path.unlink))
    return count


def _folder(path, text):
    path.mkdir(parents=True)
    (path / "id").write_text(text)


@pytest.mark.parametrize(
    ("existing", "exchange"),
    [(True, True), (True, False), (False, True)],  # a first save renames, never exchanges
    ids=["replacing-exchange", "replacing-rename-aside", "first-save"],
)
def test_crash_at_every_step_of_commit_and_recovery_gives_one_whole_save(
    tmp_path, monkeypatch, exchange, existing
):
    """Crash before each file operation of a commit, then before each one of the recovery, then
    recover: every final folder holds the same save (the new one once its record was written),
    and the next save's cleanup leaves only the final folders."""
    # a simulated crash loses nothing
    monkeypatch.setattr(ck_commit, "_fsync_path", lambda path: None)
    if not exchange:
        monkeypatch.setattr(ck_commit, "_exchange", lambda a, b: False)
    cases = 0
    for n in itertools.count(1):
        for m in itertools.count(1):
            case = tmp_path / f"{n}-{m}"
            finals = [case / "w" / "model", case / "w" / "reference", case / "o" / "optim"]
            for final in finals:
                if existing:
                    _folder(final, "old")
                _folder(ck_commit._tmp_for(final, "abc"), "new")
            with monkeypatch.context() as patch:
                done = _crash_at(patch, n)
                with contextlib.suppress(_Crash):
                    ck_commit._commit([(ck_commit._tmp_for(f, "abc"), f) for f in finals])
                commit_ops = done[0]
            committed = bool(_records(case / "w") + _records(case / "o"))
            with monkeypatch.context() as patch:
                done = _crash_at(patch, m)
                with contextlib.suppress(_Crash):
                    ck.recover_checkpoint_commits([case / "w", case / "o"])
                recovery_ops = done[0]
            ck.recover_checkpoint_commits([case / "w", case / "o"])
            assert ck.recover_checkpoint_commits([case / "w", case / "o"]) == []
            ids = {(f / "id").read_text() if f.exists() else None for f in finals}
            assert ids == (
                {"new"} if committed or commit_ops < n else {"old" if existing else None}
            )
            for final in finals:
                ck_commit._clear_stale(final)
            assert sorted(os.listdir(case / "w")) == (
                ["model", "reference"] if ids != {None} else []
            )
            cases += 1
            if recovery_ops < m:  # the recovery ran to its end: no later crash point
                break
        if commit_ops < n:
            break
    assert cases > 40


def test_recovery_with_a_folder_moved_away_names_it(tmp_path):
    final = tmp_path / "w" / "model"
    _folder(final, "old")
    _folder(ck_commit._tmp_for(final, "abc"), "new")
    ck_commit._write_commit_records("abc", [(ck_commit._tmp_for(final, "abc"), final)])
    os.rename(ck_commit._tmp_for(final, "abc"), tmp_path / "elsewhere")
    with pytest.raises(ck.CheckpointError, match=r"model\.tmp-abc' is gone.*put the save's"):
        ck.recover_checkpoint_commits([tmp_path / "w"])
    assert (final / "id").read_text() == "old"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_contiguous_runs_of_a_block_tiling_rebuild_the_tensor(data):
    """Writing every block of any tiling run by run reproduces the row-major bytes."""
    shape = data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=4), label="shape")
    cuts = [
        sorted(set(data.draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2)))) if n > 1 else []
        for n in shape
    ]
    full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32).reshape(shape)
    edges = [[0, *c, n] for c, n in zip(cuts, shape, strict=True)]
    out = torch.full((full.numel(),), -1.0)
    full_box = tuple((0, n) for n in shape)
    for block in itertools.product(*(list(zip(e[:-1], e[1:], strict=True)) for e in edges)):
        block = tuple(block)
        piece = full[tuple(slice(a, b) for a, b in block)].contiguous()
        for offset, idx, n in contiguous_runs(block, full_box):
            src = piece[idx] if idx else piece
            out[offset : offset + n] = src.reshape(-1)[:n]
    assert torch.equal(out, full.reshape(-1))


def test_safetensors_plan_is_readable_by_safetensors_and_splits_files():
    from safetensors.torch import load

    specs = {
        "a": ((3, 4), torch.float32),
        "b": ((5,), torch.bfloat16),
        "c": ((), torch.int64),
        "layers.experts.gate_up_proj": ((2, 4, 3), torch.float32),
    }
    fused = torch.empty(2, 4, 3)  # [E, 2I, H]: each expert's gate rows, then its up rows
    expert_views = [
        (f"layers.experts.{e}.{part}_proj.weight", fused[e, 2 * h : 2 * h + 2])
        for e in range(2)
        for h, part in enumerate(("gate", "up"))
    ]
    pieces = {name: [whole_piece(name, shape)] for name, (shape, _) in specs.items()}
    pieces["layers.experts.gate_up_proj"] = [
        CheckpointPiece(n, tuple(v.shape), v.stride(), v.storage_offset()) for n, v in expert_views
    ]
    layout = ck.hf_layout(specs, tie_word_embeddings=False, pieces=pieces)
    assert [t.box for t in layout][3:5] == [((0, 1), (0, 2), (0, 3)), ((0, 1), (2, 4), (0, 3))]
    transposed = {**pieces, "a": [CheckpointPiece("a", (4, 3), (1, 4), 0)]}
    with pytest.raises(ck.CheckpointError, match="'a' is not a box of 'a'"):
        ck.hf_layout(specs, tie_word_embeddings=False, pieces=transposed)
    assert [t.name for t in layout][3:] == [
        "layers.experts.0.gate_proj.weight",
        "layers.experts.0.up_proj.weight",
        "layers.experts.1.gate_proj.weight",
        "layers.experts.1.up_proj.weight",
    ]
    plans = ck.plan_safetensors_files(layout, max_file_bytes=60)
    assert len(plans) > 1 and all(
        p.file.endswith(f"-of-{len(plans):05d}.safetensors") for p in plans
    )
    names = [n for p in plans for n in p.offsets]
    assert names == [t.name for t in layout]
    for plan in plans:
        buf = bytearray(plan.size)
        buf[: len(plan.header)] = plan.header
        tensors = load(bytes(buf))
        assert set(tensors) == set(plan.offsets)

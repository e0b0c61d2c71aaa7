"""Checkpoint faults: mismatched LoRA/full checkpoints, path names, corrupt files, unsaved saves.

Every refusal happens before the worker changes: weights, optimizer state and step count stay.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.checkpoint.layout import CheckpointError
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config

LORA = {"lora_cfg": {"enabled": True, "dim": 4, "alpha": 8}}


def _trained(path, **overrides):
    worker = PolicyWorker(make_config(path, **overrides), init_reference_model=False)
    worker.train(make_batch(4, 10, seed=41), NLLLoss())
    return worker


def _snapshot(worker):
    weights = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    optim = {id(p): {k: v.clone() for k, v in s.items()} for p, s in worker.optimizer.state.items()}
    return weights, optim


def _same(worker, snapshot):
    weights, optim = snapshot
    state = worker.model.state_dict()
    return (
        state.keys() == weights.keys()
        and all(torch.equal(state[k], weights[k]) for k in state)
        and all(
            torch.equal(v, optim[id(p)][k])
            for p, s in worker.optimizer.state.items()
            for k, v in s.items()
        )
    )


@pytest.fixture(scope="module")
def saved(tiny_model_paths, tmp_path_factory):
    """A full and a LoRA checkpoint of the tiny Llama, each with its optimizer."""
    root = tmp_path_factory.mktemp("ckpt_faults")
    full = _trained(tiny_model_paths["llama"])
    full.save_checkpoint(root / "full", root / "full_optim", is_final_checkpoint=True)
    lora = _trained(tiny_model_paths["llama"], dtensor_cfg=LORA)
    lora.save_checkpoint(root / "lora", root / "lora_optim", is_final_checkpoint=True)
    return root


def test_a_lora_checkpoint_into_a_full_worker_is_refused_before_anything_changes(
    tiny_model_paths, saved
):
    worker = _trained(tiny_model_paths["llama"])
    before = _snapshot(worker)
    for optim in (None, saved / "lora_optim"):
        with pytest.raises(
            CheckpointError, match="holds a LoRA adapter .* this worker has no LoRA"
        ):
            worker.load_checkpoint(saved / "lora", optim)
        assert _same(worker, before)
    with pytest.raises(CheckpointError, match=r"state for 28 parameter\(s\).*\(LoRA adapters\)"):
        worker.load_checkpoint(saved / "full", saved / "lora_optim")
    assert _same(worker, before)


def test_a_full_optimizer_checkpoint_into_a_lora_worker_is_a_clear_error(tiny_model_paths, saved):
    worker = _trained(tiny_model_paths["llama"], dtensor_cfg=LORA)
    before = _snapshot(worker)
    try:
        worker.load_checkpoint(saved / "lora", saved / "full_optim")
    except Exception as err:  # torch's CheckpointException is a BaseException and escaped this
        assert isinstance(err, CheckpointError) and "does not train" in str(err)
    else:
        pytest.fail("a full fine-tuning optimizer state loaded into a LoRA worker")
    assert _same(worker, before)


@pytest.mark.parametrize(
    ("weights", "optim"),
    [("w", "optim"), ("run/model", "run/optim"), ("run", "run/optim")],
    ids=["optim-named-optim", "weights-named-model", "optim-inside-weights"],
)
def test_the_paths_a_save_was_given_load_it_back(tiny_model_paths, tmp_path, weights, optim):
    worker = _trained(tiny_model_paths["llama"])
    worker.save_checkpoint(tmp_path / weights, tmp_path / optim, is_final_checkpoint=True)
    after_save = _snapshot(worker)
    worker.train(make_batch(4, 10, seed=42), NLLLoss())
    worker.load_checkpoint(tmp_path / weights, tmp_path / optim)
    assert _same(worker, after_save)


def test_an_async_save_is_committed_by_shutdown(tiny_model_paths, tmp_path):
    worker = _trained(tiny_model_paths["llama"])
    worker.save_checkpoint(tmp_path / "w", tmp_path / "o")  # async: staged, not yet renamed
    worker.shutdown()
    fresh = _trained(tiny_model_paths["llama"])
    fresh.load_checkpoint(tmp_path / "w", tmp_path / "o")  # the save landed whole


def _one_file(folder, pattern):
    [path] = sorted(folder.rglob(pattern))
    return path


def test_bad_json_and_edited_headers_name_the_file(tiny_model_paths, saved, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(saved / "full", copy)
    worker = _trained(tiny_model_paths["llama"])
    index = _one_file(copy, "model.safetensors.index.json")
    index.write_text("{ not json")
    with pytest.raises(CheckpointError, match=str(index)):
        worker.load_checkpoint(copy)
    shutil.rmtree(copy)
    shutil.copytree(saved / "full", copy)
    shard = _one_file(copy, "model-*.safetensors")
    raw = bytearray(shard.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "F16" if header[name]["dtype"] == "F32" else "F32"
    edited = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    shard.write_bytes(bytes(raw[:8]) + edited + bytes(raw[8 + size :]))
    with pytest.raises(CheckpointError, match=str(shard)):
        worker.load_checkpoint(copy)


@pytest.mark.parametrize(
    "target",
    [
        "model-*.safetensors",
        "optim/*.distcp",
        "swapped-header-offsets",
        "model.safetensors.index.json",
    ],
)
def test_a_flipped_byte_anywhere_names_the_file_and_changes_nothing(
    tiny_model_paths, tmp_path, target
):
    import shutil

    source = _trained(tiny_model_paths["llama"])
    source.save_checkpoint(tmp_path / "w", tmp_path / "o", is_final_checkpoint=True)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy"))
    if target == "swapped-header-offsets":  # two same-shape tensors trade their bytes
        shard = _one_file(copy / "w" / "model", "model-*.safetensors")
        raw = bytearray(shard.read_bytes())
        (size,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + size])
        a, b = (
            k
            for k in header
            if k != "__metadata__"
            and header[k]["shape"]
            == header[next(iter(k2 for k2 in header if k2 != "__metadata__"))]["shape"]
        )
        header[a]["data_offsets"], header[b]["data_offsets"] = (
            header[b]["data_offsets"],
            header[a]["data_offsets"],
        )
        edited = json.dumps(header, separators=(",", ":")).encode()
        assert len(edited) <= size
        raw[8 : 8 + size] = edited.ljust(size)
        shard.write_bytes(bytes(raw))
        victim = shard
    else:  # DCP's parallel writers may split the optimizer over several files: the largest
        victim = max(sorted(copy.rglob(target)), key=lambda path: path.stat().st_size)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        victim.write_bytes(bytes(raw))
    worker = _trained(tiny_model_paths["llama"])
    before = _snapshot(worker)
    with pytest.raises(CheckpointError, match=rf"{victim}' does not match the digest"):
        worker.load_checkpoint(copy / "w", copy / "o")
    assert _same(worker, before)


def test_exiting_with_an_unfinalized_save_says_so(tiny_model_paths, tmp_path):
    import subprocess
    import sys

    from tests.helpers import child_env

    script = (
        "import torch\n"
        "from policyworker.functional.loss import NLLLoss\n"
        "from policyworker.shell.worker.policy_worker import PolicyWorker\n"
        "from tests.shell.conftest import make_batch, make_config\n"
        f"cfg = make_config({tiny_model_paths['llama']!r})\n"
        "w = PolicyWorker(cfg, init_reference_model=False)\n"
        f"w.save_checkpoint({str(tmp_path / 'w')!r})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "never finalized" in done.stderr and "model.tmp-" in done.stderr

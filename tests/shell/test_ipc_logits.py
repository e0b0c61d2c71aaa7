"""Full teacher logits over shared storage: a real worker produces, another process consumes."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
import transformers
from safetensors.torch import load_file

from policyworker.errors import DataError
from policyworker.shell import ipc_logits as L
from policyworker.shell.refit.zmq.ipc_files import SHM_DIR
from policyworker.shell.worker import inference
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.helpers import child_env
from tests.shell.conftest import make_batch, make_config

CONSUMER = r"""
import json, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file
from policyworker.shell.ipc_logits import open_logits_handle
records = json.loads(sys.stdin.read())
views = [open_logits_handle(r) for r in records]
save_file({f"s{r['sample_index']}": v.contiguous() for r, v in zip(records, views)}, sys.argv[1])
views[0][0, 0] = 12345.0  # in place: the producer must see this write
"""


def _consume(records, out):
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", CONSUMER, str(out)],
        input=json.dumps(records),
        text=True,
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return load_file(out)


def test_another_process_reads_every_samples_logits_in_place(tiny_model_paths, tmp_path):
    path = tiny_model_paths["llama"]
    worker = PolicyWorker(make_config(path), init_optimizer=False, init_reference_model=False)
    data = make_batch(3, 7, seed=4, lengths=[7, 2, 5])
    out = inference.full_logits_ipc(worker.state, data, micro_batch_size=2)
    records = out["per_sample_handles"]
    assert out["dp_rank"] == 0 and [r["sample_index"] for r in records] == [0, 1, 2]
    assert [(r["buf_idx"], r["sample_index_in_buf"]) for r in records] == [(0, 0), (0, 1), (1, 0)]
    vocab = worker.model.config.vocab_size
    first = records[0]
    assert first["storage_shape"] == (2, 2, 7, vocab) and first["actual_shape"] == (7, vocab)
    assert (first["vocab_start_index"], first["vocab_end_index"], first["full_vocab_size"]) == (
        0,
        vocab,
        vocab,
    )
    assert (
        first["dtype"] == "float32" and not first["vocab_sharded"] and not first["sequence_sharded"]
    )
    assert (
        len({json.dumps(r["payload_ipc"]) for r in records}) == 1
    )  # one handle for the whole storage
    got = _consume(records, tmp_path / "logits.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=data["input_ids"], use_cache=False).logits.float()
    assert (
        L.open_logits_handle(records[0])[0, 0] == 12345.0
    )  # the consumer wrote into the shared storage
    for r in records:
        local = L.open_logits_handle(r).clone()
        if r["sample_index"] == 0:
            local[0, 0] = got["s0"][0, 0]  # the value before the consumer's write
        assert torch.equal(got[f"s{r['sample_index']}"], local)
        assert torch.allclose(local, expected[r["sample_index"]], rtol=1e-5, atol=1e-5)
    name = first["payload_ipc"]["name"]
    again = inference.full_logits_ipc(worker.state, data, micro_batch_size=2)["per_sample_handles"]
    assert (
        again[0]["payload_ipc"] == first["payload_ipc"]
    )  # same request: cached storage and handle
    bigger = inference.full_logits_ipc(worker.state, make_batch(5, 7, seed=5), micro_batch_size=2)[
        "per_sample_handles"
    ]
    assert bigger[0]["payload_ipc"]["name"] != name and not os.path.exists(
        os.path.join(SHM_DIR, name)
    )
    assert bigger[0]["storage_shape"] == (3, 2, 7, vocab)
    L.close_logits_handles()
    inference.release_ipc_buffer(worker.state)
    assert not os.path.exists(os.path.join(SHM_DIR, bigger[0]["payload_ipc"]["name"]))
    inference.release_ipc_buffer(worker.state)  # idempotent


def test_buffer_reallocates_only_when_a_dim_grows_or_the_dtype_changes():
    buffer = L.TeacherLogitsBuffer()
    first = buffer.ensure((2, 1, 4, 8), torch.float32, "cpu")
    handle = buffer.handle
    assert buffer.ensure((2, 1, 4, 8), torch.float32, "cpu") is first and buffer.handle is handle
    assert buffer.ensure((1, 1, 3, 8), torch.float32, "cpu") is first  # fits: reuse
    grown = buffer.ensure((3, 1, 2, 8), torch.float32, "cpu")
    assert grown is not first and tuple(grown.shape) == (3, 1, 4, 8)  # max of old and new per dim
    assert buffer.handle["name"] != handle["name"] and buffer.num_allocations == 2
    assert buffer.ensure((3, 1, 4, 8), torch.bfloat16, "cpu").dtype == torch.bfloat16
    assert buffer.num_allocations == 3
    name = buffer.handle["name"]
    buffer.release()
    assert buffer.storage is None and not os.path.exists(os.path.join(SHM_DIR, name))
    with pytest.raises(ValueError, match=r"call ensure\(shape, dtype, device\) first"):
        _ = buffer.handle


def test_packing_and_dynamic_batching_are_refused_before_any_forward():
    for key in ("sequence_packing", "dynamic_batching"):
        cfg = types.SimpleNamespace(sequence_packing=None, dynamic_batching=None)
        setattr(cfg, key, object())
        with pytest.raises(DataError, match="needs fixed microbatches"):
            inference.full_logits_ipc(types.SimpleNamespace(cfg=cfg), {})


def test_a_handle_naming_a_foreign_file_is_refused():
    record = {
        "payload_ipc": {"kind": "shm", "name": "../etc/passwd", "size": 4},
        "dtype": "float32",
        "storage_shape": [1],
        "actual_shape": [1, 1],
        "buf_idx": 0,
        "sample_index_in_buf": 0,
    }
    with pytest.raises(ValueError, match="does not match"):
        L.open_logits_handle(record)

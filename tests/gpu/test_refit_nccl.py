"""CUDA paths of the collective refit, the SGLang payload and the teacher-logits buffer.

Two processes on one GPU cannot form an NCCL group (NCCL refuses two ranks on one device), so
the NCCL broadcast needs two GPUs (``multigpu``); on one GPU the CUDA IPC logits buffer and the
SGLang payload (CUDA tensors as IPC handles) are checked across two processes.
"""

import pickle
import socket
import struct
import subprocess
import sys

import pytest
import torch

from policyworker.shell import ipc_logits as L
from policyworker.shell.refit import collective as C
from policyworker.shell.refit import sglang as S
from tests.helpers import child_env

pytestmark = pytest.mark.gpu

CHILD = r"""
import os, pickle, struct, sys
import torch

def read():
    n = struct.unpack("<Q", sys.stdin.buffer.read(8))[0]
    return pickle.loads(sys.stdin.buffer.read(n))

def write(obj):
    data = pickle.dumps(obj)
    sys.stdout.buffer.write(struct.pack("<Q", len(data)) + data)
    sys.stdout.buffer.flush()

while True:
    cmd = read()
    op = cmd["op"]
    if op == "exit":
        break
    try:
        if op == "logits":
            from policyworker.shell.ipc_logits import open_logits_handle
            views = [open_logits_handle(r) for r in cmd["records"]]
            write({"ok": True, "values": [v.cpu() for v in views]})
            views[0].fill_(7.0)
            torch.cuda.synchronize()
        elif op == "sglang_setup":
            from policyworker.shell.refit.sglang import SGLangReceiverAdapter
            got = {}
            adapter = SGLangReceiverAdapter(
                lambda pairs: got.update({n: t.clone() for n, t in pairs}),
                refit_info=cmd["refit_info"],
            )
            write({"ok": True})
        elif op == "sglang_call":
            reply = adapter.update_weights_from_tensor(**cmd["kwargs"])
            torch.cuda.synchronize()  # copies done before the producer may free its buckets
            write({"ok": True, "reply": reply, "got": {n: t.cpu() for n, t in got.items()}})
        elif op == "nccl_receive":
            from policyworker.shell.refit import collective as C
            torch.cuda.set_device(1)
            group = C.init_collective(
                "127.0.0.1", cmd["port"], 2, train_world_size=1, rank=1, device="cuda:1",
                timeout_s=60,
            )
            got = {}
            receiver = C.CollectiveWeightReceiver(
                lambda pairs: got.update({n: t.clone() for n, t in pairs}),
                group=group, refit_info=cmd["refit_info"],
            )
            reports = [
                receiver.receive(refit_timeout_s=30).num_buckets for _ in range(cmd["rounds"])
            ]
            write({"ok": True, "reports": reports, "got": {n: t.cpu() for n, t in got.items()}})
    except Exception as exc:
        write({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
"""


class _Child:
    def __init__(self):
        env = child_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )

    def send(self, **cmd):
        data = pickle.dumps(cmd)
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()

    def reply(self):
        n = struct.unpack("<Q", self.proc.stdout.read(8))[0]
        answer = pickle.loads(self.proc.stdout.read(n))
        assert answer["ok"], answer
        return answer

    def close(self):
        self.send(op="exit")
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def child():
    proc = _Child()
    yield proc
    proc.close()


def test_cuda_ipc_logits_are_read_and_written_in_place_by_another_process(child):
    buffer = L.TeacherLogitsBuffer()
    storage = buffer.ensure((2, 3, 5, 16), torch.float32, "cuda")
    storage.copy_(torch.randn(2, 3, 5, 16, device="cuda"))
    torch.cuda.synchronize()
    records = [
        {
            "payload_ipc": buffer.handle,
            "buf_idx": b,
            "sample_index_in_buf": i,
            "storage_shape": (2, 3, 5, 16),
            "actual_shape": (4, 16),
            "dtype": "float32",
        }
        for b in range(2)
        for i in range(3)
    ]
    child.send(op="logits", records=records)
    values = child.reply()["values"]
    for r, v in zip(records, values, strict=True):
        assert torch.equal(v, storage[r["buf_idx"], r["sample_index_in_buf"], :4].cpu())
    child.send(op="logits", records=records[:1])  # a cached mapping; its write lands in our storage
    child.reply()
    torch.cuda.synchronize()
    assert bool((storage[0, 0, :4] == 7.0).all())
    assert buffer.ensure((2, 3, 5, 16), torch.float32, "cuda") is storage
    buffer.release()


def test_sglang_payload_of_cuda_tensors_round_trips_through_another_process(child):
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        "w": torch.randn(64, 32, device="cuda", generator=g).to(torch.bfloat16),
        "bias": torch.randn(8, device="cuda", generator=g),
        "ids": torch.arange(5, device="cuda"),
    }
    info = {n: (torch.Size(t.shape), t.dtype) for n, t in tensors.items()}
    child.send(op="sglang_setup", refit_info=info)
    child.reply()
    answers = []

    class Engine:  # forwards each call to the child; the payload bytes hold CUDA IPC handles
        def update_weights_from_tensor(self, **kwargs):
            child.send(op="sglang_call", kwargs=kwargs)
            answers.append(child.reply())
            return answers[-1]["reply"]

    report = S.update_weights_to_sglang_colocated(
        list(tensors.items()),
        rollout_engines=[Engine()],
        buffer_size_bytes=1024,
        num_gpus_per_engine=1,
    )
    assert report["num_calls"] == 3 and all(a["reply"]["success"] for a in answers)
    got = answers[-1]["got"]
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor.cpu())


@pytest.mark.multigpu
def test_nccl_broadcast_between_two_gpus_in_both_layouts(child):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = torch.Generator().manual_seed(1)
    tensors = {
        "w": torch.randn(300, 70, generator=g),
        "s": torch.tensor(2.5),
        "ids": torch.arange(9),
        "h": torch.randn(33, generator=g),
    }
    info = {
        "w": (torch.Size([300, 70]), torch.bfloat16),
        "s": (torch.Size([]), torch.bfloat16),
        "ids": (torch.Size([9]), torch.int64),
        "h": (torch.Size([33]), torch.float32),
    }
    child.send(op="nccl_receive", port=port, refit_info=info, rounds=2)
    group = C.init_collective(
        "127.0.0.1", port, 2, train_world_size=1, rank=0, device="cuda:0", timeout_s=60
    )
    cuda = [(n, t.cuda()) for n, t in tensors.items()]
    reports = [
        group.broadcast_weights(
            cuda,
            refit_info=info,
            buffer_size_bytes=20000,
            num_buffers=2,
            use_legacy_packing=legacy,
            refit_timeout_s=30,
        )
        for legacy in (False, True)
    ]
    answer = child.reply()
    assert answer["reports"] == [r["num_buckets"] for r in reports]
    for name, tensor in tensors.items():
        assert torch.equal(answer["got"][name], tensor.to(info[name][1]))

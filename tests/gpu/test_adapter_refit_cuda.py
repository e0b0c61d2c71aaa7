"""Adapter-only refits over CUDA IPC between two processes on one GPU, one-pass and staged: the
steady-state path (the sender's cached adapter walk, its plain tensors copied with cached copy
groups) lands the trainer's bf16 cast bit for bit, also after the edits a trainer makes between
refits (values in place, ``.data =``, a parameter replaced)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from policyworker.shell.model.lora import LinearLoRA
from policyworker.shell.refit.adapter_refit import adapter_refit_info, adapter_stream
from policyworker.shell.refit.sender import RefitSender

pytestmark = pytest.mark.gpu

CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file
from torch import nn
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.functional.wire.codec import DTYPES_BY_NAME
cmd = json.loads(sys.argv[1])
info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in json.load(open(cmd["refit_info"])).items()}
root = nn.Module()
for name, (shape, dtype) in info.items():
    *path, leaf = name.split(".")
    node = root
    for part in path:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    zeros = torch.zeros(shape, dtype=dtype, device="cuda")
    node.register_parameter(leaf, nn.Parameter(zeros, requires_grad=False))
receiver = HFWeightReceiver(root, address=cmd["address"], refit_info=info, timeout_s=120)
print("READY", flush=True)
reports = [receiver.receive() for _ in range(cmd["num_refits"])]
state = {k: v.cpu().contiguous() for k, v in root.state_dict().items()}
save_file(
    {"versions": torch.tensor([r.version for r in reports]),
     "buckets": torch.tensor([r.num_buckets for r in reports]), **state},
    cmd["out"],
)
receiver.close()
"""


def _model() -> nn.Module:
    root = nn.Module()
    root.layers = nn.ModuleList()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        block = nn.Module()
        for name, (out_features, in_features) in {
            "q_proj": (64, 64),
            "down_proj": (64, 256),
        }.items():
            layer = LinearLoRA(in_features, out_features, bias=False, dim=16, alpha=32.0)
            with torch.no_grad():
                layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g))
            setattr(block, name, layer)
        root.layers.append(block)
    return root.cuda()


@pytest.mark.parametrize("one_pass", [None, False], ids=["one_pass", "staged"])
def test_cuda_adapter_refits_land_the_trainers_bf16_cast_after_each_edit(tmp_path, one_pass):
    model = _model()
    sender = RefitSender(lambda: model, torch.bfloat16, device="cuda", keep_staging=True)
    info = adapter_refit_info(model, dtype=torch.bfloat16)
    with open(tmp_path / "info.json", "w") as info_file:
        json.dump(
            {n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()}, info_file
        )
    cmd = {
        "refit_info": str(tmp_path / "info.json"),
        "address": sender.get_zmq_address(),
        "out": str(tmp_path / "out.safetensors"),
        "num_refits": 4,
    }
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(cmd)],
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        },
    )

    def refit() -> None:
        stream = sender.adapter_stream()
        assert stream.plain is not None
        sender.send(stream, stream.sources, buffer_size_bytes=0, timeout_s=120, one_pass=one_pass)

    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        refit()
        refit()  # the steady state: walk, views or slots and copy groups all reused
        with torch.no_grad():
            model.layers[0].q_proj.lora_B.weight.mul_(1.5)
        weight = model.layers[1].down_proj.lora_A.weight
        weight.data = weight.data * 2.0  # new storage, same parameter object
        refit()
        holder = model.layers[2].q_proj.lora_B
        holder.weight = nn.Parameter(torch.randn_like(holder.weight))  # a new parameter object
        refit()
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
        sender.close()
    got = load_file(tmp_path / "out.safetensors")
    assert got["versions"].tolist() == [1, 2, 3, 4]
    assert bool((got["buckets"] == 0).all()) == (one_pass is None)
    for source in adapter_stream(model, dtype=torch.bfloat16).sources:
        assert torch.equal(got[source.name], source.tensor.to(torch.bfloat16).cpu()), source.name

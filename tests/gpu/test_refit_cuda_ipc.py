"""Staged CUDA IPC refit between two processes on one GPU: bitwise parity with the trainer's
weights. The receiver declines one-pass (tests/gpu/test_refit_one_pass_cuda.py covers that
default), so the sender's staging buffers, their sizes and keeping them are what is tested."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config

from policyworker.shell.refit.sender import RefitSender

pytestmark = pytest.mark.gpu

CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.functional.wire.codec import DTYPES_BY_NAME
cmd = json.loads(sys.argv[1])
config = AutoConfig.from_pretrained(cmd["config_dir"])
config._attn_implementation = "eager"
torch.manual_seed(99)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in json.load(open(cmd["refit_info"])).items()}
receiver = HFWeightReceiver(
    model, address=cmd["address"], refit_info=info, timeout_s=120, one_pass=False
)
print("READY", flush=True)
versions = [receiver.receive().version for _ in range(cmd["num_refits"])]
# The same forward over the trainer's bf16 cast loaded by plain load_state_dict, in this process:
# same kernels, so refit parity means bitwise-equal logprobs.
reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
reference.load_state_dict({k: v.cuda() for k, v in load_file(cmd["expected"]).items()})
with torch.no_grad():
    ids = load_file(cmd["batch"])["input_ids"].cuda()
    logprobs = torch.log_softmax(model(ids).logits.float(), -1).cpu()
    expected = torch.log_softmax(reference(ids).logits.float(), -1).cpu()
state = {k: v.cpu().contiguous() for k, v in model.state_dict().items()}
save_file(
    {"logprobs": logprobs, "expected": expected, "versions": torch.tensor(versions), **state},
    cmd["out"],
)
receiver.close()
"""


def test_cuda_ipc_refit_gives_bitwise_identical_logprobs(tmp_path):
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    cfg.save_pretrained(tmp_path)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).cuda().eval()  # fp32 master
    sender = RefitSender(lambda: model, torch.bfloat16, device="cuda")
    info = sender.prepare_refit_info()
    with open(tmp_path / "info.json", "w") as info_file:
        json.dump(
            {n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()},
            info_file,
        )
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "batch.safetensors")
    cmd = {
        "config_dir": str(tmp_path),
        "refit_info": str(tmp_path / "info.json"),
        "address": sender.get_zmq_address(),
        "batch": str(tmp_path / "batch.safetensors"),
        "out": str(tmp_path / "out.safetensors"),
        "num_refits": 4,
        "expected": str(tmp_path / "expected.safetensors"),
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
    try:
        assert child.stdout.readline().strip() == "READY"
        sender.stream_weights_via_ipc_zmq(timeout_s=120)  # default buffers
        sender.stream_weights_via_ipc_zmq(
            buffer_size_bytes=48 << 10, timeout_s=120
        )  # many buckets; embeddings oversized
        sender.stream_weights_via_ipc_zmq(
            buffer_size_bytes=1 << 20, timeout_s=120, keep_staging=True
        )
        assert (
            sender._zmq().kept_staging_bytes > 0
        )  # the CUDA buffers stay shared for the next refit
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)
        cast = {k: v.to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(cast, tmp_path / "expected.safetensors")
        # the same kept buffers (the receiver reuses its IPC mappings) carry the changed weights
        report = sender.stream_weights_via_ipc_zmq(
            buffer_size_bytes=1 << 20, timeout_s=120, keep_staging=True
        )
        assert report["version"] == 4
        sender.release_staging()
        assert sender._zmq().kept_staging_bytes == 0
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
        sender.close()
    got = load_file(tmp_path / "out.safetensors")
    assert got["versions"].tolist() == [1, 2, 3, 4]
    for name, tensor in cast.items():  # the refit delivered the trainer's bf16 cast bit for bit
        assert torch.equal(got[name], tensor), name
    assert torch.equal(got["logprobs"], got["expected"])

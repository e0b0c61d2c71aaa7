"""One-pass refit over CUDA IPC between two processes on one GPU: the sender casts its fp32
master weights straight into the receiver's registered CUDA arena."""

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
    model, address=cmd["address"], refit_info=info, timeout_s=120, one_pass=True,
    atomic=cmd["atomic"],
)
arena = receiver.arena.tensor
assert all(
    p.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    for p in model.parameters()
)
print("READY", flush=True)
reports = [receiver.receive() for _ in range(cmd["num_refits"])]
reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
reference.load_state_dict({k: v.cuda() for k, v in load_file(cmd["expected"]).items()})
with torch.no_grad():
    ids = load_file(cmd["batch"])["input_ids"].cuda()
    logprobs = torch.log_softmax(model(ids).logits.float(), -1).cpu()
    expected = torch.log_softmax(reference(ids).logits.float(), -1).cpu()
state = {k: v.cpu().clone() for k, v in model.state_dict().items()}
save_file(
    {
        "logprobs": logprobs,
        "expected": expected,
        "versions": torch.tensor([r.version for r in reports]),
        "buckets": torch.tensor([r.num_buckets for r in reports]),
        **state,
    },
    cmd["out"],
)
receiver.close()
"""


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_cuda_one_pass_refit_gives_the_trainers_bf16_cast_bit_for_bit(tmp_path, atomic):
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
    sender = RefitSender(lambda: model, torch.bfloat16, device="cuda", one_pass=True)
    info = sender.prepare_refit_info()
    with open(tmp_path / "info.json", "w") as info_file:
        json.dump(
            {n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()}, info_file
        )
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "batch.safetensors")
    cmd = {
        "config_dir": str(tmp_path),
        "refit_info": str(tmp_path / "info.json"),
        "address": sender.get_zmq_address(),
        "batch": str(tmp_path / "batch.safetensors"),
        "out": str(tmp_path / "out.safetensors"),
        "expected": str(tmp_path / "expected.safetensors"),
        "num_refits": 4,
        "atomic": atomic,
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
        sender.stream_weights_via_ipc_zmq(timeout_s=120)
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)
        sender.stream_weights_via_ipc_zmq(timeout_s=120)
        sender.stream_weights_via_ipc_zmq(timeout_s=120, one_pass=False)  # staged still works
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.add_(0.25)
        cast = {k: v.to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(cast, tmp_path / "expected.safetensors")
        assert sender.stream_weights_via_ipc_zmq(timeout_s=120)["version"] == 4
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
        sender.close()
    got = load_file(tmp_path / "out.safetensors")
    assert got["versions"].tolist() == [1, 2, 3, 4]
    assert got["buckets"].tolist()[:2] == [0, 0] and got["buckets"][2] > 0
    for name, tensor in cast.items():
        assert torch.equal(got[name], tensor), name
    assert torch.equal(got["logprobs"], got["expected"])

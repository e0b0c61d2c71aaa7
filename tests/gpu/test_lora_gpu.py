"""LoRA on one CUDA device: bf16 adapters (the default there) merged into the frozen weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from policyworker.functional.lora import merge_lora_weight
from policyworker.functional.loss import NLLLoss
from policyworker.shell.model.lora import LinearLoRA
from policyworker.shell.worker.policy_worker import PolicyWorker

# the session fixture tiny_model_paths comes from tests/gpu/conftest.py
from tests.shell.conftest import make_batch, make_config

pytestmark = pytest.mark.gpu

LORA = {"lora_cfg": {"match_all_linear": True, "dim": 4, "alpha": 8}}


def test_a_cuda_lora_layer_computes_with_the_refit_weights_bit_for_bit():
    torch.manual_seed(0)
    lora = LinearLoRA.from_linear(
        nn.Linear(256, 384, device="cuda"), dim=16, alpha=32.0, compute_dtype=torch.bfloat16
    )
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(2, 64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = lora(x)
    merged = merge_lora_weight(lora.weight, lora.lora_A.weight, lora.lora_B.weight, lora.scale)
    engine = F.linear(x.bfloat16(), merged.bfloat16(), lora.bias.bfloat16())
    assert torch.equal(out, engine)


def test_the_default_compiled_lora_worker_trains_and_matches_the_eager_one(tiny_model_paths):
    """Compiled and eager layers merge by the same fp32 GEMM; the compiled layers fuse the rest
    (RMSNorm, SiLU, casts) in another order, so both workers agree within bf16 compute noise."""
    path = tiny_model_paths["qwen2"]
    sgd = {"name": "torch.optim.SGD", "kwargs": {"lr": 1e-2}}
    workers = [
        PolicyWorker(
            make_config(
                path, precision="bfloat16", optimizer=sgd, dtensor_cfg={**LORA, "fusion": fusion}
            ),
            init_reference_model=False,
        )
        for fusion in ("auto", "none")
    ]
    compiled, eager = workers
    assert compiled.fusion_report.fused_layers > 0 and eager.fusion_report.fused_layers == 0
    for worker in workers:
        assert {worker.model.get_submodule(n).compute_dtype for n in worker.lora_module_names} == {
            torch.bfloat16
        }
    for seed in range(2):
        data = make_batch(8, 16, seed=seed)
        losses = [w.train(data, NLLLoss())["global_loss"] for w in workers]
        torch.testing.assert_close(losses[0], losses[1], atol=0.02, rtol=0.01)
    data = make_batch(8, 16, seed=40)
    got, want = compiled.get_logprobs(data)["logprobs"], eager.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)

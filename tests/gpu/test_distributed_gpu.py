"""FSDP2 with bf16 mixed precision on one GPU; TP / CP logprob parity on two GPUs (multigpu)."""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from policyworker.functional import logprobs as lp_core
from policyworker.shell.parallel import collectives
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.parallel.plans import move_buffers, parallelize_model, reshard
from tests.distributed import workers
from tests.distributed.launch import run_on_nccl

pytestmark = pytest.mark.gpu

_SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_gpu")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**_SHAPE)).save_pretrained(path)
    return str(path)


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank NCCL process group (file rendezvous), destroyed after the test."""
    dist.init_process_group(
        "cuda:nccl,cpu:gloo",  # CPU offload reduces CPU gradients
        init_method=f"file://{tmp_path / 'rdzv'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", 0),
    )
    try:
        yield ParallelContext.from_environment(device=torch.device("cuda", 0), timeout_s=60)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_fsdp2_bf16_mixed_precision_trains_with_fp32_master_weights(
    world_of_one, llama_path, cpu_offload
):
    ctx, device = world_of_one, torch.device("cuda", 0)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0)).to(device)
    reference = workers._load(llama_path).to(device)
    with torch.no_grad():
        ref_lp = lp_core.next_token_logprobs(reference(input_ids=ids).logits, ids)

    model = workers._load(llama_path)
    if not cpu_offload:
        model = model.to(device)
    model = parallelize_model(model, ctx, precision=torch.bfloat16, cpu_offload=cpu_offload)
    if cpu_offload:
        move_buffers(model, device)  # FSDP2 moves parameters for compute, never buffers
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())
    expected_param_device = "cpu" if cpu_offload else "cuda"
    assert all(p.device.type == expected_param_device for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert logits.dtype == torch.bfloat16
        lp = collectives.next_token_logprobs_any(logits, ids, ctx)
    torch.testing.assert_close(lp, ref_lp, atol=0.1, rtol=0.05)  # bf16 compute vs fp32
    reshard(model)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = -collectives.next_token_logprobs_any(model(input_ids=ids).logits, ids, ctx).mean()
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        norm = collectives.total_grad_norm(model.parameters(), ctx)
        assert torch.isfinite(norm)
        collectives.clip_grads_(model.parameters(), 1.0, norm)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_worker_under_a_one_rank_nccl_group_trains_fsdp2_bf16_and_offloads(
    world_of_one, llama_path
):
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import hf_reference_logprobs, make_batch, make_config

    worker = PolicyWorker(make_config(llama_path, precision="bfloat16"))
    assert worker.parallel.mesh is not None and worker.device.type == "cuda"
    assert all(
        isinstance(p, DTensor) and p.dtype == torch.float32 for p in worker.model.parameters()
    )
    data = make_batch(8, 16, seed=41)
    lp = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(lp, hf_reference_logprobs(llama_path, data), atol=0.1, rtol=0.05)
    losses = [float(worker.train(data, NLLLoss())["global_loss"][0]) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    worker.offload_after_refit()
    torch.cuda.synchronize()
    offloaded = torch.cuda.memory_allocated()
    worker.prepare_for_training()
    assert torch.cuda.memory_allocated() > offloaded  # weights and optimizer state came back
    assert float(worker.train(data, NLLLoss())["global_loss"][0]) < losses[0]
    worker.shutdown()


@pytest.mark.multigpu
def test_tp2_and_cp2_logprobs_match_one_gpu(llama_path):
    run_on_nccl(workers.gpu_tp_and_cp_parity, 2, llama_path)

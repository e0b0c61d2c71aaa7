"""PolicyWorker on one CUDA device: bf16 numerics, varlen packing, offload memory."""

import gc

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.model.attention import VARLEN_ATTN_NAME, varlen_kernel_available
from policyworker.shell.worker.policy_worker import PolicyWorker

# the session fixture tiny_model_paths comes from tests/gpu/conftest.py
from tests.shell.conftest import (
    hf_reference_logprobs,
    make_batch,
    make_config,
)

pytestmark = pytest.mark.gpu

PACKED = {"sequence_packing": {"train_mb_tokens": 48, "logprob_mb_tokens": 48}}


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_low_precision_train_and_logprobs_are_finite_with_fp32_outputs(tiny_model_paths, precision):
    worker = PolicyWorker(make_config(tiny_model_paths["qwen2"], precision=precision))
    assert worker.device.type == "cuda"
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())
    data = make_batch(8, 16, seed=31)
    losses = [worker.train(data, NLLLoss())["global_loss"] for _ in range(3)]
    assert all(x.dtype == torch.float32 and torch.isfinite(x).all() for x in losses)
    lp = worker.get_logprobs(data)["logprobs"]
    assert lp.dtype == torch.float32 and lp.shape == (8, 16) and torch.isfinite(lp).all()


def test_varlen_packing_matches_unpacked_logprobs_in_bf16(tiny_model_paths, monkeypatch):
    from policyworker.shell.model import attention

    calls = []
    flash = attention._flash_varlen
    monkeypatch.setattr(
        attention, "_flash_varlen", lambda *a, **kw: calls.append(a[0].dtype) or flash(*a, **kw)
    )
    path = tiny_model_paths["llama"]
    eager = {"fusion": "none"}  # the patched kernel is counted from eager Python, not a graph
    packed = PolicyWorker(
        make_config(path, precision="bfloat16", **PACKED, dtensor_cfg=eager),
        init_optimizer=False,
        init_reference_model=False,
    )
    assert varlen_kernel_available(packed.device)
    assert packed.model.config._attn_implementation == VARLEN_ATTN_NAME
    plain = PolicyWorker(
        make_config(path, precision="bfloat16", dtensor_cfg=eager),
        init_optimizer=False,
        init_reference_model=False,
    )
    data = make_batch(6, 16, seed=32, lengths=[16, 3, 11, 7, 1, 14])
    got, want = packed.get_logprobs(data)["logprobs"], plain.get_logprobs(data)["logprobs"]
    assert calls and set(calls) == {torch.bfloat16}  # the flash varlen kernel ran, in bf16
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # bf16 compute noise
    torch.testing.assert_close(want, hf_reference_logprobs(path, data), atol=0.1, rtol=0.05)


def test_varlen_packed_training_matches_unpacked_loss(tiny_model_paths):
    path = tiny_model_paths["qwen3"]
    data = make_batch(8, 16, seed=33)
    losses = []
    for extra in (PACKED, {}):
        worker = PolicyWorker(
            make_config(path, precision="bfloat16", **extra), init_reference_model=False
        )
        losses.append(worker.train(data, NLLLoss())["global_loss"])
    torch.testing.assert_close(losses[0], losses[1], atol=0.02, rtol=0.02)


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _warm_up_cuda_libraries() -> None:
    """cuBLAS workspaces live in the caching allocator for the process: create them first."""
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (x @ x).float().sum().backward()
    (x @ x).sum().backward()


def test_offload_after_refit_frees_model_and_optimizer_memory(tiny_model_paths):
    _warm_up_cuda_libraries()
    baseline = _allocated()
    worker = PolicyWorker(
        make_config(tiny_model_paths["llama"], precision="bfloat16"), init_reference_model=False
    )
    data = make_batch(4, 16, seed=34)
    worker.train(data, NLLLoss())
    param_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    opt_bytes = sum(
        v.numel() * v.element_size()
        for s in worker.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.is_cuda
    )
    resident = _allocated() - baseline
    assert resident >= param_bytes + opt_bytes
    worker.offload_before_refit()
    worker.offload_after_refit()
    assert _allocated() - baseline == 0
    assert all(p.device.type == "cpu" for p in worker.model.parameters())
    worker.prepare_for_training()
    assert _allocated() - baseline >= param_bytes + opt_bytes
    assert worker.train(data, NLLLoss())["skipped_steps"] == 0


def test_offload_after_refit_frees_the_draft_and_its_optimizer_too(tiny_model_paths):
    _warm_up_cuda_libraries()
    baseline = _allocated()
    worker = PolicyWorker(
        make_config(tiny_model_paths["llama"], precision="bfloat16", draft={}),
        init_reference_model=False,
    )
    data = make_batch(4, 16, seed=34)
    worker.train(data, NLLLoss())
    draft = worker.state.draft
    draft_bytes = sum(p.numel() * p.element_size() for p in draft.model.parameters())
    assert all(p.is_cuda for p in draft.model.parameters()) and draft.optimizer.state
    worker.offload_before_refit()
    worker.offload_after_refit()
    assert _allocated() - baseline == 0
    assert all(p.device.type == "cpu" for p in draft.model.parameters())
    worker.prepare_for_training()
    assert _allocated() - baseline >= draft_bytes
    assert all(v.is_cuda for s in draft.optimizer.state.values() for v in s.values() if v.ndim > 0)
    assert worker.train(data, NLLLoss())["skipped_steps"] == 0


@pytest.mark.parametrize("mode", ["layer", "norm_mlp", "auto"])
def test_fused_worker_matches_eager_on_packed_bf16_logprobs_and_training(tiny_model_paths, mode):
    path = tiny_model_paths["qwen3"]
    data = make_batch(8, 16, seed=34)
    sgd = {"name": "torch.optim.SGD", "kwargs": {"lr": 1e-3}}
    eager = PolicyWorker(
        make_config(
            path, precision="bfloat16", optimizer=sgd, **PACKED, dtensor_cfg={"fusion": "none"}
        )
    )
    fused = PolicyWorker(
        make_config(
            path, precision="bfloat16", optimizer=sgd, **PACKED, dtensor_cfg={"fusion": mode}
        )
    )
    report = fused.fusion_report
    assert report.fallback_reason is None and (report.fused_layers or report.fused_mlps)
    assert report.logprobs == "fused" and eager.fusion_report.logprobs == "eager"
    got, want = fused.get_logprobs(data)["logprobs"], eager.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # bf16 compute noise
    for _ in range(2):  # packed [1, N] microbatches of two sizes reuse / recompile the graphs
        loss_fused, loss_eager = fused.train(data, NLLLoss()), eager.train(data, NLLLoss())
        torch.testing.assert_close(
            loss_fused["global_loss"], loss_eager["global_loss"], atol=0.02, rtol=0.01
        )


def test_entropy_and_topk_come_with_the_default_workers_logprobs_in_bf16(tiny_model_paths):
    """The default (fused) worker, packed varlen bf16: get_logprobs(entropy, top_k) gives the
    logprobs and top-k of the separate calls bit for bit, and the entropy of the fp32
    reference softmax within bf16 compute noise."""
    import transformers

    path = tiny_model_paths["qwen2"]
    worker = PolicyWorker(
        make_config(path, precision="bfloat16", **PACKED, generation={"temperature": 1.3}),
        init_optimizer=False,
        init_reference_model=False,
    )
    assert worker.fusion_report.logprobs == "fused"
    data = make_batch(6, 16, seed=36, lengths=[16, 3, 11, 7, 1, 14])
    out = worker.get_logprobs(data, entropy=True, top_k=3)
    assert torch.equal(out["logprobs"], worker.get_logprobs(data)["logprobs"])
    topk = worker.get_topk_logits(data, 3)
    assert torch.equal(out["topk_indices"], topk["topk_indices"])
    assert torch.equal(out["topk_logits"], topk["topk_logits"])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        x = model(input_ids=data["input_ids"], use_cache=False).logits.double() / 1.3
    entropy = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    want = torch.cat([torch.zeros(6, 1), entropy[:, :-1].float()], dim=1)
    valid = torch.arange(16)[None] < data["input_lengths"][:, None]
    want = torch.where(valid, want, torch.zeros_like(want))
    torch.testing.assert_close(out["entropy"], want, atol=0.05, rtol=0.02)  # bf16 compute noise


def test_default_worker_fuses_layers_on_cuda(tiny_model_paths):
    """`fusion: auto` (the default) is `layer` on CUDA in one process, with no fallback."""
    worker = PolicyWorker(make_config(tiny_model_paths["qwen2"], precision="bfloat16"))
    report = worker.fusion_report
    assert (report.requested, report.mode, report.fallback_reason) == ("auto", "layer", None)
    assert report.fused_layers > 0 and report.summary() == "layer (auto); logprobs fused"


def test_async_save_stages_into_pinned_reused_buffers(tiny_model_paths, tmp_path):
    from policyworker.shell import checkpoint as ck

    path = tiny_model_paths["qwen2"]
    worker = PolicyWorker(make_config(path, precision="bfloat16"), init_reference_model=False)
    data = make_batch(8, 16, seed=35)
    worker.train(data, NLLLoss())
    ck.save_checkpoint(worker.state, tmp_path / "a", tmp_path / "a")
    ck.finalize_async_save(worker.state)
    staging = worker.state.saver.staging
    arenas = dict(staging._arenas)
    assert arenas and all(a.registered for a in arenas.values())  # page-locked in place
    worker.train(data, NLLLoss())
    before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    ck.save_checkpoint(worker.state, tmp_path / "b", tmp_path / "b")
    assert all(staging._arenas[g] is a for g, a in arenas.items())  # reused, not reallocated
    worker.train(data, NLLLoss())  # overwrites the weights right after the save returned
    ck.finalize_async_save(worker.state)
    fresh = PolicyWorker(make_config(path, precision="bfloat16"), init_reference_model=False)
    ck.load_checkpoint(fresh.state, tmp_path / "b", tmp_path / "b")
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items())
    worker.shutdown()
    assert staging.nbytes == 0


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_logprob_kernels_match_eager_at_a_real_vocab_in_bf16(temperature):
    """The compiled pair on a Qwen-sized vocab (151,936) and 2,000 packed positions: values
    within `LOGPROB_ATOL/RTOL` of the eager pair, bf16 gradients within
    `assert_logprob_grads_close`'s bound; the one-read entropy within the same tolerance of the
    eager one."""
    from policyworker.functional import logprobs as lp
    from policyworker.functional.logprob_kernels import EAGER_KERNELS
    from policyworker.functional.sampling import Sampling
    from policyworker.shell.kernels.fused_logprobs import (
        LOGPROB_ATOL,
        LOGPROB_RTOL,
        fused_logprob_kernels,
    )
    from tests.shell.kernels.test_fused_logprobs import assert_scored_grads_close

    vocab, cuda = 151_936, torch.device("cuda")
    kernels, reason = fused_logprob_kernels(
        "layer", device=cuda, vocab_size=vocab, logits_dtype=torch.bfloat16, temperature=temperature
    )
    assert reason is None and kernels.whole
    gen = torch.Generator(device=cuda).manual_seed(5)
    logits = (3 * torch.randn(1, 2000, vocab, generator=gen, device=cuda)).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (1, 2000), generator=gen, device=cuda)
    weights = torch.randn(1, 1999, generator=gen, device=cuda)
    results = []
    for pair in (EAGER_KERNELS, kernels):
        x = logits.clone().requires_grad_()
        out = lp.next_token_logprobs(
            x, ids, sampling=Sampling(temperature=temperature), kernels=pair
        )
        (out * weights).sum().backward()
        results.append((out, x.grad))
    (want, want_grad), (got, got_grad) = results
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    assert_scored_grads_close(got_grad, want_grad, logits, weights, temperature)
    got_entropy = lp.token_entropy(logits, temperature=temperature, kernels=kernels)
    want_entropy = lp.token_entropy(logits, temperature=temperature)  # eager, chunked
    torch.testing.assert_close(got_entropy, want_entropy, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)

"""Per-rank bodies for the gloo tests (module level so the launcher can run them).

Each body runs many checks inside one process group (a launch costs seconds on 2 cores). Every
rank computes the single-process fp32 reference itself, from the same files and seeds, so the
comparison needs no extra process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoModelForCausalLM

from policyworker.functional import context_parallel as cp_core
from policyworker.functional import logprobs as lp_core
from policyworker.functional import vocab_parallel as vp_core
from policyworker.functional.sampling import Sampling, apply_sampling_filters
from policyworker.shell.parallel import collectives
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.parallel.plans import move_buffers, parallelize_model, reshard

ATOL = 1e-5  # fp32 parity with one process (API.md / issue 5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got, want, what: str, *, atol: float = ATOL, rtol: float = 1e-5) -> None:
    try:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    except AssertionError as err:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: {err}") from None


def _reference_logprobs(logits_BSV, token_ids_BS, *, temperature=1.0, top_k=None, top_p=1.0):
    x = logits_BSV[:, :-1].double() / temperature
    x = apply_sampling_filters(x, top_k=top_k, top_p=top_p)
    return torch.log_softmax(x, -1).gather(-1, token_ids_BS[:, 1:, None])[..., 0]


def _vocab_shard(full_BSV, rank, size):
    start, stop = vp_core.vocab_range(rank, size, full_BSV.shape[-1])
    return full_BSV[..., start:stop]


def _dtensor_leaf(full_BSV, mesh, rank, size):
    local = _vocab_shard(full_BSV, rank, size).detach().clone().requires_grad_()
    dt = DTensor.from_local(
        local, mesh, [Shard(2)], run_check=False, shape=full_BSV.shape, stride=full_BSV.stride()
    )
    return local, dt


# ------------------------------------------------------------------------------ collectives


def check_vocab_parallel_logprobs(rank, size, ctx, vocab_sizes):
    """Forward and backward == full log_softmax for even/uneven vocab, chunks and temperature."""
    for case, vocab in enumerate(vocab_sizes):
        g = _gen(100 + case)
        logits = 10 * torch.randn(2, 7, vocab, generator=g)
        ids = torch.randint(0, vocab, (2, 7), generator=g)
        weight = torch.randn(2, 6, generator=g)
        for chunk, temperature in ((None, 1.0), (3, 0.7)):
            full = logits.clone().requires_grad_()
            want = _reference_logprobs(full, ids, temperature=temperature)
            (want * weight).sum().backward()
            local = _vocab_shard(logits, rank, size).clone().requires_grad_()
            got = collectives.vocab_parallel_next_token_logprobs(
                local,
                ids,
                tp_group=ctx.groups["tp"],
                tp_rank=ctx.tp_rank,
                tp_size=size,
                vocab_size=vocab,
                temperature=temperature,
                chunk_size=chunk,
            )
            _close(got, want.float(), f"vocab-parallel logprobs V={vocab} chunk={chunk}")
            (got * weight).sum().backward()
            _close(local.grad, _vocab_shard(full.grad, rank, size).float(), f"grad V={vocab}")
    # Large logits and all targets = 0 stay finite and exact.
    logits = 100 * torch.randn(1, 5, vocab_sizes[0], generator=_gen(7))
    ids = torch.zeros(1, 5, dtype=torch.int64)
    got = collectives.vocab_parallel_next_token_logprobs(
        _vocab_shard(logits, rank, size),
        ids,
        tp_group=ctx.groups["tp"],
        tp_rank=ctx.tp_rank,
        tp_size=size,
        vocab_size=vocab_sizes[0],
    )
    assert torch.isfinite(got).all()
    _close(got, _reference_logprobs(logits, ids).float(), "large logits")


def check_dtensor_logprobs_with_filters(rank, size, ctx, vocab):
    """DTensor (vocab-sharded) logits: plain, top-k, top-p and both; forward + backward."""
    tp_mesh = ctx.mesh["tp"]
    g = _gen(11)
    batch, seq = 2, 2 * size  # B*S divisible by tp
    logits = 3 * torch.randn(batch, seq, vocab, generator=g)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    weight = torch.randn(batch, seq - 1, generator=g)
    for top_k, top_p, chunk in ((None, 1.0, None), (5, 1.0, None), (None, 0.9, 3), (7, 0.8, 2)):
        full = logits.clone().requires_grad_()
        want = _reference_logprobs(full, ids, temperature=0.9, top_k=top_k, top_p=top_p)
        finite = torch.isfinite(want)
        (torch.where(finite, want, 0) * weight).sum().backward()
        local, dt = _dtensor_leaf(logits, tp_mesh, rank, size)
        got = collectives.next_token_logprobs_any(
            dt,
            ids,
            ctx,
            sampling=Sampling(temperature=0.9, top_k=top_k, top_p=top_p),
            chunk_size=chunk,
        )
        assert torch.equal(torch.isfinite(got), finite), f"filtered set differs k={top_k} p={top_p}"
        _close(
            torch.where(finite, got, 0),
            torch.where(finite, want, 0).float(),
            f"k={top_k} p={top_p}",
        )
        (torch.where(finite, got, 0) * weight).sum().backward()
        _close(local.grad, _vocab_shard(full.grad, rank, size).float(), f"grad k={top_k} p={top_p}")
    # B*S not divisible by tp -> the documented error, on every rank, before any collective.
    odd = torch.randn(1, size + 1, vocab)
    _, dt = _dtensor_leaf(odd, tp_mesh, rank, size)
    try:
        collectives.next_token_logprobs_any(
            dt, torch.zeros(1, size + 1, dtype=torch.int64), ctx, sampling=Sampling(top_k=3)
        )
    except ValueError as err:
        assert "make_sequence_length_divisible_by" in str(err), err
    else:
        raise AssertionError("B*S % tp != 0 with top-k under TP did not raise")


def check_distributed_topk(rank, size, ctx, vocab):
    """Top-k over vocab shards == single-process fp32 top-k exactly (values), indices global."""
    g = _gen(21)
    logits = torch.randn(2, 5, vocab, generator=g).to(torch.bfloat16)
    start, _ = vp_core.vocab_range(rank, size, vocab)
    for k, chunk in ((1, None), (5, 2), (min(vocab, 3 * (vocab // size) + 1), None)):
        values, indices = collectives.distributed_topk(
            _vocab_shard(logits, rank, size),
            k,
            tp_group=ctx.groups["tp"],
            vocab_start=start,
            chunk_size=chunk,
        )
        want = torch.topk(logits.float(), k, dim=-1).values
        torch.testing.assert_close(values, want, atol=0, rtol=0)
        assert indices.dtype == torch.int64
        torch.testing.assert_close(logits.float().gather(-1, indices), want, atol=0, rtol=0)


def check_vocab_parallel_entropy(rank, size, ctx, vocab_sizes):
    """entropy_any of vocab-sharded DTensor logits (some shards may be empty) == the
    single-process entropy of the whole vocab, at any chunk size."""
    for vocab in vocab_sizes:
        logits = (3 * torch.randn(2, 5, vocab, generator=_gen(31))).to(torch.bfloat16)
        _, dt = _dtensor_leaf(logits, ctx.mesh["tp"], rank, size)
        want = lp_core.token_entropy(logits, temperature=0.8)
        for chunk in (None, 2):
            got = collectives.entropy_any(dt, temperature=0.8, chunk_size=chunk)
            _close(got, want, f"vocab {vocab} chunk {chunk}: entropy", atol=1e-5)


def check_cp_gather(rank, size):
    """Head-tail shards gather back exactly (dims 1 and 0, 2-D); backward per reference §6.6."""
    group = dist.group.WORLD
    for shape, dim in (((3, 4 * size, 5), 1), ((4 * size, 3), 0), ((2, 2 * size), 1)):
        full = torch.randn(*shape, generator=_gen(31 + dim))
        shard = (
            cp_core.shard_for_rank(full, cp_rank=rank, cp_size=size, dim=dim)
            .clone()
            .requires_grad_()
        )
        gathered = collectives.all_gather_cp(shard, cp_group=group, cp_size=size, dim=dim)
        assert torch.equal(gathered, full), f"cp gather round trip dim={dim}"
        (gathered**2).sum().backward()
        _close(shard.grad / size, 2 * shard.detach(), "cp gather backward")
    try:
        ParallelContext.from_environment(cp_size=size)
    except ValueError as err:
        assert "no CPU kernel" in str(err), err
    else:
        raise AssertionError("cp_size > 1 on CPU did not raise")


def check_grad_norm_placements(rank, size, ctx):
    """Shard, Replicate and plain grads: the norm of the full gradients, nothing double counted."""
    mesh = ctx.mesh["tp"]
    g = _gen(41)
    full_a, full_b, plain = (
        torch.randn(4 * size, 3, generator=g),
        torch.randn(5, generator=g),
        torch.randn(2, generator=g),
    )
    params = []
    for full, placement in ((full_a, Shard(0)), (full_b, Replicate())):
        p = torch.nn.Parameter(
            DTensor.from_local(
                full.chunk(size)[rank] if placement.is_shard() else full.clone(),
                mesh,
                [placement],
                run_check=False,
            )
        )
        p.grad = DTensor.from_local(
            (full.chunk(size)[rank] if placement.is_shard() else full).clone(),
            mesh,
            [placement],
            run_check=False,
        )
        params.append(p)
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = plain.clone()
    params.append(p)
    want = torch.cat([full_a.flatten(), full_b, plain]).norm()
    norm = collectives.total_grad_norm(params, ctx)
    _close(norm, want, "grad norm")
    collectives.clip_grads_(params, 0.5 * float(want), norm)
    clipped = collectives.total_grad_norm(params, ctx)
    _close(clipped, 0.5 * want, "clipped grad norm", atol=1e-5, rtol=1e-4)


def collectives_suite(rank, size, vocab_sizes, run_topk):
    ctx = ParallelContext.from_environment(tp_size=size, timeout_s=60)
    check_vocab_parallel_logprobs(rank, size, ctx, vocab_sizes)
    check_dtensor_logprobs_with_filters(rank, size, ctx, vocab_sizes[0])
    check_vocab_parallel_entropy(rank, size, ctx, vocab_sizes)
    if run_topk:
        check_distributed_topk(rank, size, ctx, vocab_sizes[-1])
    check_cp_gather(rank, size)
    check_grad_norm_placements(rank, size, ctx)
    assert ctx.local_coords() == {
        "data_parallel": 0,
        "context_parallel": 0,
        "tensor_parallel": rank,
    }
    assert dist.get_world_size(ctx.replica_group()) == size


# ----------------------------------------------------------------------------------- models

STEPS, LR, MAX_GRAD_NORM = 3, 2e-4, 0.05


def _batch(vocab, batch=4, seq=8):
    g = _gen(51)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq)
    mask[1, 5:] = 0  # a padded row
    mask[3, 3:] = 0
    return ids, mask


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    return model


def _loss(logprobs_BS1, mask_BS, global_tokens):
    return -(logprobs_BS1 * mask_BS[:, 1:]).sum() / global_tokens


def _reference_run(path, ids, mask):
    """Single process fp32: logits, logprobs, per-step loss and grad norm, final params."""
    torch.manual_seed(0)
    model = _load(path)
    logits = model(input_ids=ids).logits.detach()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    tokens = mask[:, 1:].sum()
    for _ in range(STEPS):
        opt.zero_grad()
        lp = lp_core.next_token_logprobs(model(input_ids=ids).logits, ids)
        loss = _loss(lp, mask, tokens)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM))
        losses.append(loss.detach())
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return logits, losses, norms, params


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _parallel_run(path, ctx, ids, mask, **parallel_kwargs):
    torch.manual_seed(0)
    model = parallelize_model(_load(path), ctx, precision=torch.float32, **parallel_kwargs)
    rows = slice(
        ctx.dp_rank * ids.shape[0] // ctx.dp_size, (ctx.dp_rank + 1) * ids.shape[0] // ctx.dp_size
    )
    my_ids, my_mask = ids[rows], mask[rows]
    with torch.no_grad():
        raw = model(input_ids=my_ids).logits
        logits = _full(raw)
        logprobs = collectives.next_token_logprobs_any(raw, my_ids, ctx)
    reshard(model)  # FSDP2 leaves root params unsharded after a no-grad forward
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = mask[:, 1:].sum()  # global normalizer (the all-reduce over dp is the worker's job)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        lp = collectives.next_token_logprobs_any(model(input_ids=my_ids).logits, my_ids, ctx)
        loss = _loss(lp, my_mask, tokens)
        (loss * ctx.dp_size * ctx.cp_size).backward()  # FSDP2 averages over dp x cp
        norm = collectives.total_grad_norm(model.parameters(), ctx)
        collectives.clip_grads_(model.parameters(), MAX_GRAD_NORM, norm)
        losses.append(ctx.all_reduce(loss.detach().clone(), axis="dp"))
        norms.append(norm)
        opt.step()
    params = {n: _full(p).detach() for n, p in model.named_parameters()}
    return rows, logits, logprobs, losses, norms, params, model


def check_model_parity(ctx, path, label, ids, mask, **parallel_kwargs):
    ref_logits, ref_losses, ref_norms, ref_params = _reference_run(path, ids, mask)
    rows, logits, logprobs, losses, norms, params, model = _parallel_run(
        path, ctx, ids, mask, **parallel_kwargs
    )
    _close(logits, ref_logits[rows], f"{label}: logits")
    _close(logprobs, _reference_logprobs(ref_logits[rows], ids[rows]).float(), f"{label}: logprobs")
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        _close(got, want, f"{label}: global loss at step {step}")
    for step, (got, want) in enumerate(zip(norms, ref_norms, strict=True)):
        # After an AdamW step, TP's different fp32 reduction order shows at ~2e-5 relative.
        _close(got, want.float(), f"{label}: pre-clip grad norm at step {step}", rtol=1e-4)
    assert ref_norms[0] > MAX_GRAD_NORM, "the clip must be active for this check to mean anything"
    assert params.keys() == ref_params.keys(), f"{label}: parameter names changed"
    for name, want in ref_params.items():
        _close(params[name], want, f"{label}: {name} after {STEPS} AdamW steps")
    if getattr(model.config, "tie_word_embeddings", False):
        assert model.lm_head.weight is model.get_input_embeddings().weight, f"{label}: untied"
    move_buffers(model, "cpu")
    return model


def model_suite(rank, size, model_paths, layouts):
    """For each (tp_size, parallelize kwargs, model names): logits, logprobs, loss, norm, params."""
    vocab = _load(next(iter(model_paths.values()))).config.vocab_size
    ids, mask = _batch(vocab)
    contexts = {}
    for tp_size, kwargs, names in layouts:
        if tp_size not in contexts:
            contexts[tp_size] = ParallelContext.from_environment(tp_size=tp_size, timeout_s=60)
        ctx = contexts[tp_size]
        for name in names:
            label = f"{name} dp{ctx.dp_size}xtp{ctx.tp_size} {kwargs}"
            check_model_parity(ctx, model_paths[name], label, ids, mask, **kwargs)


def tp_divisibility_error(rank, size, path):
    """tp that does not divide the kv heads: a ValueError naming the key, model unchanged."""
    ctx = ParallelContext.from_environment(tp_size=size, timeout_s=60)
    model = _load(path)
    before = {n: type(p) for n, p in model.named_parameters()}
    try:
        parallelize_model(model, ctx, precision=torch.float32)
    except ValueError as err:
        assert "num_key_value_heads" in str(err) and "tensor_parallel_size" in str(err), err
    else:
        raise AssertionError("tp that does not divide num_key_value_heads did not raise")
    assert {n: type(p) for n, p in model.named_parameters()} == before


# ------------------------------------------------------------------------------- failures


def one_rank_raises(rank, size):
    """Rank 1 raises while the others wait in a collective: the job must end, not hang."""
    ctx = ParallelContext.from_environment(timeout_s=60)
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    ctx.all_reduce(torch.ones(1), axis="world")
    init_device_mesh("cpu", (size,))  # never reached on time: rank 1 is gone


# ------------------------------------------------------------------------------ GPU (NCCL)


def gpu_tp_and_cp_parity(rank, size, path):
    """TP=size and CP=size on CUDA: logits / logprobs == one GPU (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", rank)
    ids, mask = _batch(128, batch=2, seq=8 * size)
    ids = ids.to(device)
    reference = _load(path).to(device)
    with torch.no_grad():
        ref_logits = reference(input_ids=ids).logits
    ref_lp = _reference_logprobs(ref_logits, ids).float()

    tp_ctx = ParallelContext.from_environment(tp_size=size, device=device, timeout_s=60)
    model = parallelize_model(_load(path).to(device), tp_ctx, precision=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        _close(_full(logits), ref_logits, "tp logits on cuda", atol=1e-4, rtol=1e-4)
        lp = collectives.next_token_logprobs_any(logits, ids, tp_ctx)
        _close(lp, ref_lp, "tp logprobs on cuda", atol=1e-4, rtol=1e-4)
        values, indices = collectives.topk_any(logits, 5)
        torch.testing.assert_close(
            values, torch.topk(ref_logits.float(), 5).values, atol=1e-4, rtol=1e-4
        )

    cp_ctx = ParallelContext.from_environment(cp_size=size, device=device, timeout_s=60)
    model = parallelize_model(_load(path).to(device), cp_ctx, precision=torch.float32)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    with torch.no_grad():
        local = collectives.context_parallel_forward(model, cp_ctx, ids, positions)
        lp = collectives.cp_next_token_logprobs(local, ids, cp_ctx)
    _close(lp, ref_lp, "cp logprobs on cuda", atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------- PolicyWorker, parallel

WORKER_BATCHING = {
    "fixed": {},
    "dynamic": {"dynamic_batching": {"train_mb_tokens": 16, "sequence_length_round": 4}},
    "packed": {"sequence_packing": {"train_mb_tokens": 16}},
}
SAMPLING = {"temperature": 0.8, "top_k": 16, "top_p": 0.9}
# (label, batching, sampling filters on, loss, extra config)
WORKER_CASES = (
    ("fixed-nll", "fixed", False, "nll", {}),
    ("dynamic-pg-kl-filtered", "dynamic", True, "pg_kl", {}),
    ("packed-pg-kl-filtered", "packed", True, "pg_kl", {}),
)
LORA_CASE = ("fixed-nll-lora", "fixed", False, "nll", {"lora_cfg": {"dim": 4, "alpha": 8.0}})
# dp rank 0 gets the long rows, dp rank 1 the short ones: under dynamic batching and packing the
# ranks plan different microbatch counts, so rank 1 runs dummy microbatches.
WORKER_LENGTHS = (12, 11, 3, 2)


def _worker_loss(kind):
    from policyworker.functional.loss import ClippedPGLossFn, NLLLoss

    if kind == "nll":
        return NLLLoss()
    return ClippedPGLossFn({"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k3"})


def _worker_config(path, *, tp_size, batching="fixed", sampling=False, extra=None):
    from tests.shell.conftest import make_config

    dtensor = {"tensor_parallel_size": tp_size} | dict(extra or {})
    cfg = make_config(
        path,
        train_global_batch_size=4,
        train_micro_batch_size=1,
        max_grad_norm=MAX_GRAD_NORM,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.0}},
        dtensor_cfg=dtensor,
        **WORKER_BATCHING[batching],
    )
    if sampling:
        cfg["generation"] = dict(SAMPLING)
    return cfg


def _worker_data():
    from tests.shell.conftest import make_batch

    return make_batch(4, 12, seed=5, lengths=WORKER_LENGTHS)


def _worker_params(worker):
    worker._reshard()
    return {n: _full(p).detach().clone() for n, p in worker.model.named_parameters()}


def _exercise_worker(worker, data, loss_kind, *, calibrate):
    """Every output the parity checks compare: inference, two train calls, reference swap."""
    out = {"logprobs": worker.get_logprobs(data)["logprobs"]}
    topk = worker.get_topk_logits(data, 5)
    out["topk_logits"], out["topk_indices"] = topk["topk_logits"], topk["topk_indices"]
    together = worker.get_logprobs(data, entropy=True, top_k=5)  # one pass under TP too
    for key in ("logprobs", "topk_logits", "topk_indices"):
        assert torch.equal(together[key], out[key]), f"{key} with entropy and top-k differs"
    out["entropy"] = together["entropy"]
    if calibrate:
        out["kv_scales"] = worker.calibrate_qkv_fp8_scales(data)["kv_scales"]
    results = [worker.train(data, _worker_loss(loss_kind)) for _ in range(2)]
    out["losses"] = [r["global_loss"] for r in results]
    out["grad_norms"] = [r["grad_norm"] for r in results]
    out["logprobs_after"] = worker.get_logprobs(data)["logprobs"]
    ref = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
    out["reference_logprobs"] = ref
    out["params"] = _worker_params(worker)
    return out


def worker_references(path, cases):
    """Single-process fp32 outputs of every case (run in the test process, before the fork)."""
    from policyworker.shell.worker.policy_worker import PolicyWorker

    refs = {}
    for label, batching, sampling, loss_kind, extra in cases:
        torch.manual_seed(0)
        worker = PolicyWorker(
            _worker_config(path, tp_size=1, batching=batching, sampling=sampling, extra=extra),
            parallel=ParallelContext.single(torch.device("cpu")),
        )
        refs[label] = _exercise_worker(worker, _worker_data(), loss_kind, calibrate=True)
        worker.shutdown()
    return refs


def _check_worker_case(worker, label, loss_kind, want):
    ctx = worker.parallel
    data = _worker_data()
    per_dp = data["input_ids"].shape[0] // ctx.dp_size
    rows = slice(ctx.dp_rank * per_dp, (ctx.dp_rank + 1) * per_dp)
    shard = {k: v[rows] for k, v in data.items()}
    name = f"PolicyWorker dp{ctx.dp_size}xtp{ctx.tp_size} {label}"
    if ctx.dp_size > 1 and worker.cfg.train_micro_batch_size and not label.startswith("fixed"):
        dummies = sum(p.is_dummy for p in worker._inference_plans(shard, None))
        assert (dummies > 0) == (ctx.dp_rank == 1), f"{name}: dummy microbatches {dummies}"
    got = _exercise_worker(worker, shard, loss_kind, calibrate="kv_scales" in want)
    for key in ("logprobs", "entropy", "topk_logits", "logprobs_after", "reference_logprobs"):
        _close(got[key], want[key][rows], f"{name}: {key}")
    assert torch.equal(got["topk_indices"], want["topk_indices"][rows]), f"{name}: top-k ids"
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        _close(g, w, f"{name}: global loss of train call {step}")
    for step, (g, w) in enumerate(zip(got["grad_norms"], want["grad_norms"], strict=True)):
        _close(torch.tensor(g), torch.tensor(w), f"{name}: grad norm {step}", rtol=1e-4)
    if "kv_scales" in got:
        assert got["kv_scales"].keys() == want["kv_scales"].keys(), name
        for k, w in want["kv_scales"].items():
            _close(torch.tensor(got["kv_scales"][k]), torch.tensor(w), f"{name}: {k}", rtol=1e-4)
    assert got["params"].keys() == want["params"].keys(), f"{name}: parameter names"
    for key, w in want["params"].items():
        _close(got["params"][key], w, f"{name}: {key} after train")
    return got["params"]


def _check_zmq_refit(worker, params):
    """Rank 0 receives a refit from the sharded worker in a thread: the full trained weights."""
    import threading

    from policyworker.errors import RefitError, RefitTimeoutError
    from policyworker.shell.refit.receiver import HFWeightReceiver

    info = worker.prepare_refit_info()  # collective-safe: every rank, same answer
    target = _load(worker.cfg.model_name) if dist.get_rank() == 0 else None
    errors, thread = [], None
    if target is not None:
        receiver = HFWeightReceiver(
            target, address=worker.get_zmq_address(), refit_info=info, timeout_s=60.0
        )

        def serve():
            try:
                receiver.receive()
            except Exception as err:  # noqa: BLE001 - re-raised in the rank below
                errors.append(err)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
    report = worker.stream_weights_via_ipc_zmq(timeout_s=60.0)
    assert (report is None) == (dist.get_rank() != 0), report
    if thread is not None:
        thread.join(60)
        receiver.close()
        assert not errors, errors
        for name, value in target.named_parameters():
            assert torch.equal(value.detach(), params[name]), f"refit: {name}"
    # The receiver is gone: rank 0 times out, still finishes the gathers, and every rank raises.
    expected = RefitTimeoutError if dist.get_rank() == 0 else RefitError
    try:
        worker.stream_weights_via_ipc_zmq(timeout_s=1.0)
    except RefitError as err:
        assert isinstance(err, expected), repr(err)
        assert "rank 0" in str(err) or dist.get_rank() == 0, err
    else:
        raise AssertionError("a refit without a receiver did not raise")


def worker_parity(rank, size, path, tp_sizes, references, extra_checks=()):
    """PolicyWorker under each tp size (dp = world / tp) == one process, case by case."""
    from policyworker.shell.worker.policy_worker import PolicyWorker

    cases = [c for c in WORKER_CASES + (LORA_CASE,) if c[0] in references]
    for tp_size in tp_sizes:
        for label, batching, sampling, loss_kind, extra in cases:
            if extra.get("lora_cfg") and tp_size == 1:
                continue
            torch.manual_seed(0)
            worker = PolicyWorker(
                _worker_config(
                    path, tp_size=tp_size, batching=batching, sampling=sampling, extra=extra
                )
            )
            p = worker.parallel
            assert f"dp×cp×tp={p.dp_size}×1×{tp_size}, rank={rank}/{size}" in repr(worker)
            assert worker.parallel.tp_size == tp_size and not worker.parallel.owns_process_group
            params = _check_worker_case(worker, label, loss_kind, references[label])
            if "sequence_parallel" in extra_checks and tp_size > 1 and label.startswith("packed"):
                worker.shutdown()
                torch.manual_seed(0)
                worker = PolicyWorker(
                    _worker_config(
                        path,
                        tp_size=tp_size,
                        batching=batching,
                        sampling=sampling,
                        extra=extra | {"sequence_parallel": True},
                    )
                )
                _check_worker_case(
                    worker, f"{label} sequence-parallel", loss_kind, references[label]
                )
            if "zmq_refit" in extra_checks and tp_size == 1 and label == "fixed-nll":
                _check_zmq_refit(worker, params)
            if "checkpoint" in extra_checks and label == "fixed-nll":
                _check_checkpoint(worker, params, f"{extra_checks['checkpoint']}/tp{tp_size}")
            if "nan_skip" in extra_checks and tp_size == 1 and label == "fixed-nll":
                _check_nan_on_one_rank_skips_everywhere(worker, params)
            if "cpu_offload" in extra_checks and tp_size == 1 and label == "fixed-nll":
                worker.shutdown()
                torch.manual_seed(0)
                worker = PolicyWorker(
                    _worker_config(
                        path,
                        tp_size=1,
                        batching=batching,
                        sampling=sampling,
                        extra=extra | {"cpu_offload": True, "activation_checkpointing": True},
                    )
                )
                worker.prepare_for_training()
                _check_worker_case(
                    worker, f"{label} cpu-offload + recompute", loss_kind, references[label]
                )
            worker.shutdown()
            assert dist.is_initialized(), "shutdown destroyed a group the worker did not create"


def _check_checkpoint(worker, params, root):
    """A sharded save (HF weights + DCP optimizer) loads into one process: the same weights."""
    from policyworker.shell.worker.policy_worker import PolicyWorker

    worker.save_checkpoint(f"{root}/weights", f"{root}/optimizer")
    worker.finalize_async_save()
    single = PolicyWorker(
        _worker_config(worker.cfg.model_name, tp_size=1),
        parallel=ParallelContext.single(torch.device("cpu")),
    )
    single.load_checkpoint(f"{root}/weights", f"{root}/optimizer")
    for name, value in single.model.named_parameters():
        assert torch.equal(value.detach(), params[name]), f"checkpoint: {name}"
    single.shutdown()


class _NaNOnRankOne:
    """NLL whose loss is NaN on global rank 1 only."""

    def __init__(self):
        from policyworker.functional.loss import NLLLoss

        self._nll = NLLLoss()
        self.loss_type, self.input_type = self._nll.loss_type, self._nll.input_type

    def __call__(self, *args, **kwargs):
        loss, metrics = self._nll(*args, **kwargs)
        return (loss * float("nan") if dist.get_rank() == 1 else loss), metrics


def _check_nan_on_one_rank_skips_everywhere(worker, params):
    """A non-finite loss on one rank skips the step on every rank: weights stay equal."""
    import warnings

    data = _worker_data()
    per_dp = data["input_ids"].shape[0] // worker.parallel.dp_size
    rows = slice(worker.parallel.dp_rank * per_dp, (worker.parallel.dp_rank + 1) * per_dp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = worker.train({k: v[rows] for k, v in data.items()}, _NaNOnRankOne())
    assert out["skipped_steps"] == 1, out["skipped_steps"]
    after = _worker_params(worker)
    for name, value in params.items():
        assert torch.equal(after[name], value), f"skipped step changed {name}"


def worker_rank_raises(rank, size, path):
    """Rank 1 passes a bad batch (ValueError before any collective); its refusal reaches rank 0
    before train's first collective, so both ranks raise and the job ends at once."""
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.worker.policy_worker import PolicyWorker

    worker = PolicyWorker(_worker_config(path, tp_size=1))
    data = _worker_data()
    if rank == 1:
        del data["sample_mask"]
    worker.train(data, NLLLoss())

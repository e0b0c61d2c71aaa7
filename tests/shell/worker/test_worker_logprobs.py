"""get_logprobs / top-k / score of PolicyWorker against plain Hugging Face forwards (fp32, CPU)."""

import contextlib

import pytest
import torch

from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import hf_reference_logprobs, make_batch, make_config

BATCHING = {
    "fixed": {},
    "dynamic": {
        "dynamic_batching": {
            "train_mb_tokens": 24,
            "logprob_mb_tokens": 24,
            "sequence_length_round": 4,
        }
    },
    "packed": {"sequence_packing": {"train_mb_tokens": 24, "logprob_mb_tokens": 20}},
}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", list(BATCHING))
@pytest.mark.parametrize("chunk", [None, 3])
def test_logprobs_equal_plain_hf_forward_in_every_batching_mode(
    tiny_model_paths, kind, mode, chunk
):
    """Rows of different lengths, any chunk size: allclose to HF fp32 + log_softmax, input order."""
    path = tiny_model_paths[kind]
    worker = PolicyWorker(
        make_config(path, logprob_chunk_size=chunk, **BATCHING[mode]),
        init_optimizer=False,
        init_reference_model=False,
    )
    data = make_batch(5, 12, seed=1, lengths=[12, 3, 9, 1, 6])
    got = worker.get_logprobs(data)["logprobs"]
    assert got.dtype == torch.float32 and got.shape == (5, 12) and got.device.type == "cpu"
    assert torch.allclose(got, hf_reference_logprobs(path, data))


def test_logprobs_chunk_size_one_and_microbatch_override(tiny_model_paths):
    path = tiny_model_paths["llama"]
    worker = PolicyWorker(
        make_config(path, logprob_chunk_size=1), init_optimizer=False, init_reference_model=False
    )
    data = make_batch(3, 10, seed=2)
    assert torch.allclose(
        worker.get_logprobs(data, micro_batch_size=3)["logprobs"], hf_reference_logprobs(path, data)
    )


def test_temperature_divides_logits_and_filters_zero_neg_inf(tiny_model_paths):
    path = tiny_model_paths["llama"]
    cfg = make_config(path, generation={"temperature": 2.0, "top_k": 2, "top_p": 1.0})
    worker = PolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
    data = make_batch(4, 10, seed=3)
    with pytest.warns(UserWarning, match="top-k/top-p mismatch"):
        got = worker.get_logprobs(data)["logprobs"]
    assert torch.isfinite(got).all()
    plain = hf_reference_logprobs(path, data, temperature=2.0)
    kept = got != 0
    # where the target survived the top-2 filter its logprob is >= the unfiltered one
    assert bool((got[kept] >= plain[kept] - 1e-6).all())
    assert bool((got[data["token_mask"] == 0] == 0).all())


@pytest.mark.parametrize("mode", ["fixed", "packed"])
def test_topk_equals_torch_topk_on_fp32_hf_logits(tiny_model_paths, mode):
    import transformers

    path = tiny_model_paths["qwen3"]
    worker = PolicyWorker(
        make_config(path, **BATCHING[mode]), init_optimizer=False, init_reference_model=False
    )
    data = make_batch(4, 10, seed=4, lengths=[10, 4, 7, 2])
    out = worker.get_topk_logits(data, k=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], use_cache=False).logits.float()
    values, indices = torch.topk(logits, 5, dim=-1)
    valid = (torch.arange(10)[None] < data["input_lengths"][:, None])[..., None]
    assert out["topk_logits"].dtype == torch.float32 and out["topk_indices"].dtype == torch.int64
    assert torch.allclose(out["topk_logits"], torch.where(valid, values, 0.0))
    assert torch.equal(out["topk_indices"], torch.where(valid, indices, 0))


def _forwards_of(worker):
    """A list that grows by one per forward of the worker's decoder stack."""
    calls = []
    worker.model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("mode", list(BATCHING))
@pytest.mark.parametrize(
    ("chunk", "generation"),
    [(None, None), (3, {"temperature": 1.7}), (None, {"temperature": 2.0, "top_k": 2})],
)
def test_entropy_and_topk_come_from_the_logprobs_forward(tiny_model_paths, mode, chunk, generation):
    """get_logprobs(entropy=True, top_k=k): the logprobs unchanged, the entropy of every
    next-token softmax(logits / T) (filters off), get_topk_logits' result, one forward."""
    import transformers

    path = tiny_model_paths["qwen2"]
    cfg = make_config(path, logprob_chunk_size=chunk, generation=generation, **BATCHING[mode])
    worker = PolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
    data = make_batch(5, 12, seed=6, lengths=[12, 3, 9, 1, 6])
    filtered = generation is not None and "top_k" in generation
    with pytest.warns(UserWarning, match="mismatch") if filtered else contextlib.nullcontext():
        alone = worker.get_logprobs(data)
    forwards = _forwards_of(worker)
    with pytest.warns(UserWarning, match="mismatch") if filtered else contextlib.nullcontext():
        out = worker.get_logprobs(data, entropy=True, top_k=4)
    plans = len(worker._inference_plans(data, None))
    assert len(forwards) == plans  # one decoder pass per microbatch, as for logprobs alone
    assert set(out) == {"logprobs", "entropy", "topk_logits", "topk_indices"}
    assert torch.equal(out["logprobs"], alone["logprobs"])
    topk = worker.get_topk_logits(data, 4)
    assert torch.equal(out["topk_logits"], topk["topk_logits"])
    assert torch.equal(out["topk_indices"], topk["topk_indices"])

    temperature = (generation or {}).get("temperature", 1.0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        x = model(input_ids=data["input_ids"], use_cache=False).logits.double() / temperature
    entropy = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)  # of position t's
    want = torch.cat([torch.zeros(5, 1), entropy[:, :-1].float()], dim=1)  # next token, at t+1
    valid = torch.arange(12)[None] < data["input_lengths"][:, None]
    want = torch.where(valid, want, torch.zeros_like(want))
    assert out["entropy"].dtype == torch.float32 and out["entropy"].shape == (5, 12)
    torch.testing.assert_close(out["entropy"], want, atol=1e-5, rtol=1e-5)
    assert bool((out["entropy"][:, 0] == 0).all()) and bool((out["entropy"][~valid] == 0).all())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"entropy": "yes"}, "entropy='yes' must be True or False"),
        ({"top_k": 0}, "top_k=0 must be a positive int"),
        ({"top_k": True}, "top_k=True must be a positive int"),
        ({"top_k": 2.5}, "top_k=2.5 must be a positive int"),
    ],
)
def test_bad_extra_statistics_are_refused_before_any_forward(tiny_model_paths, kwargs, match):
    path = tiny_model_paths["llama"]
    worker = PolicyWorker(make_config(path), init_optimizer=False, init_reference_model=False)
    forwards = _forwards_of(worker)
    with pytest.raises(ValueError, match=match):
        worker.get_logprobs(make_batch(2, 6, seed=7), **kwargs)
    assert forwards == []


@pytest.mark.parametrize("kind", ["bradley_terry", "regression"])
def test_score_matches_hf_reward_head_on_unpadded_rows(tiny_reward_paths, kind):
    import transformers

    path = tiny_reward_paths[kind]
    worker = PolicyWorker(
        make_config(path, reward_model_cfg={"reward_model_type": kind}),
        init_optimizer=False,
        init_reference_model=False,
    )
    data = make_batch(3, 8, seed=5, lengths=[8, 3, 5])
    scores = worker.score(data)["scores"]
    cls = (
        transformers.AutoModelForSequenceClassification
        if kind == "bradley_terry"
        else transformers.AutoModelForTokenClassification
    )
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    for row, n in enumerate(data["input_lengths"].tolist()):
        with torch.no_grad():
            expected = model(input_ids=data["input_ids"][row : row + 1, :n]).logits.float()
        if kind == "bradley_terry":
            assert scores.shape == (3,)
            assert torch.allclose(scores[row], expected[0, 0], atol=1e-6)
        else:
            assert scores.shape == (3, 8)
            assert torch.allclose(scores[row, :n], expected[0, :, 0], atol=1e-6)
            assert bool((scores[row, n:] == 0).all())


def test_calibrate_qkv_fp8_scales_are_percentile_abs_max_over_448(tiny_model_paths):
    path = tiny_model_paths["llama"]
    worker = PolicyWorker(make_config(path), init_optimizer=False, init_reference_model=False)
    data = make_batch(2, 8, seed=6, lengths=[8, 5])
    out = worker.calibrate_qkv_fp8_scales(data, percentile=100.0, margin=1.0, include_q=True)
    k_proj = worker.model.model.layers[1].self_attn.k_proj
    captured = []
    handle = k_proj.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    worker.get_logprobs(data)
    handle.remove()
    valid = torch.cat([captured[0][0, :8], captured[0][1, :5]])
    assert out["layers"]["model.layers.1.self_attn"]["k_scale"] == pytest.approx(
        float(valid.abs().max()) / 448.0, rel=1e-6
    )
    assert set(out["layers"]["model.layers.0.self_attn"]) == {"q_scale", "k_scale", "v_scale"}
    assert out["kv_scales"]["model.layers.0.self_attn.v_scale"] > 0


def test_bf16_logprobs_cast_the_lm_head_once_per_microbatch_not_per_chunk(tiny_model_paths):
    """Chunk by chunk under bf16 autocast, the fp32 head weight is cast to bf16 once per
    microbatch (autocast alone casts it again for every chunk); the logprobs equal the fp32
    reference within bf16 rounding."""
    from torch.profiler import ProfilerActivity, profile

    path = tiny_model_paths["llama"]
    worker = PolicyWorker(
        make_config(path, precision="bfloat16", logprob_chunk_size=3),
        init_optimizer=False,
        init_reference_model=False,
    )
    head_shape = list(worker.model.get_output_embeddings().weight.shape)
    data = make_batch(3, 12, seed=3)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        got = worker.get_logprobs(data, micro_batch_size=3)["logprobs"]
    head_casts = sum(
        e.count
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key == "aten::_to_copy" and e.input_shapes and e.input_shapes[0] == head_shape
    )
    assert head_casts == 1  # 12 positions in chunks of 3: autocast alone casts it 4 times
    assert torch.allclose(got, hf_reference_logprobs(path, data), atol=0.1)

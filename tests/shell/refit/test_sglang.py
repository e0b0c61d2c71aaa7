"""SGLang colocated refit: payload format, chunking, awaiting, and a round trip into a HF model."""

import asyncio
import concurrent.futures
import copy
import itertools
import pickle
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from policyworker.errors import RefitError
from policyworker.functional.dtypes import precision_dtype
from policyworker.shell.refit import sglang as S
from policyworker.shell.refit.weight_stream import params_generator, refit_info
from policyworker.testing import tiny_config
from tests.helpers import tiny_deepseek_v3_config


def _model(cfg, seed):
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _qwen2(tie=False):
    return tiny_config("qwen2", tie_word_embeddings=tie)


IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def _logprobs(model):
    with torch.no_grad():
        return torch.log_softmax(model(IDS).logits.float(), -1)


class _Recorder:
    """An engine handle that records every call and forwards it to an adapter."""

    def __init__(self, adapter, wrap=lambda reply: reply):
        self.adapter, self.wrap, self.calls = adapter, wrap, []

    def update_weights_from_tensor(self, **kwargs):
        self.calls.append({k: v for k, v in kwargs.items() if k != "serialized_named_tensors"})
        return self.wrap(self.adapter.update_weights_from_tensor(**kwargs))


def _future(reply):
    future = concurrent.futures.Future()
    future.set_result(reply)
    return future


async def _coroutine(reply):
    await asyncio.sleep(0)
    return reply


@pytest.mark.parametrize(
    "wrap", [lambda r: r, _future, _coroutine], ids=["sync", "future", "awaitable"]
)
def test_bf16_round_trip_into_a_hf_model_is_bitwise_the_trainers_cast(wrap):
    trainer, engine_model = _model(_qwen2(), 0), _model(_qwen2(), 1).to(torch.bfloat16)
    info = refit_info(trainer, torch.bfloat16)
    engine = _Recorder(S.SGLangReceiverAdapter(engine_model, refit_info=info), wrap)
    sender = S.SGLangColocatedSender(rank=0, world_size=1)
    sender.set_rollout_num_gpus_per_engine(1)
    for version in (1, 2):
        report = sender.update_weights(
            params_generator(trainer, torch.bfloat16),
            rollout_engines=[engine],
            buffer_size_bytes=4096,
        )
        assert report["weight_version"] == version and engine.adapter.weight_version == str(version)
        assert torch.equal(
            _logprobs(engine_model), _logprobs(copy.deepcopy(trainer).to(torch.bfloat16))
        )
        calls = engine.calls[-report["num_calls"] :]
        assert report["num_calls"] >= report["num_chunks"] > 1
        assert [c["flush_cache"] for c in calls] == [False] * (len(calls) - 1) + [True]
        assert {c["load_format"] for c in calls} == {"flattened_bucket"}
        assert {c["weight_version"] for c in calls} == {str(version)}
        with torch.no_grad():
            trainer.model.layers[0].self_attn.q_proj.weight.mul_(1.5)


def test_mixed_dtypes_travel_in_per_dtype_buckets_and_keep_the_router_bias_fp32():
    cfg = tiny_deepseek_v3_config()
    trainer = _model(cfg, 2)
    bias = trainer.model.layers[1].mlp.gate.e_score_correction_bias
    with torch.no_grad():
        bias.copy_(1.0 + 1e-3 * torch.arange(4, dtype=torch.float32))
    info = refit_info(trainer, torch.bfloat16)
    got = {}
    adapter = S.SGLangReceiverAdapter(
        lambda pairs: got.update({n: t.clone() for n, t in pairs}), refit_info=info
    )
    S.update_weights_to_sglang_colocated(
        params_generator(trainer, torch.bfloat16),
        rollout_engines=[adapter],
        buffer_size_bytes=1 << 20,
        num_gpus_per_engine=1,
    )
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert got[name].dtype == torch.float32 and torch.equal(got[name], bias)
    assert {n: t.dtype for n, t in got.items()} == {n: d for n, (_, d) in info.items()}


def test_a_failing_chunk_surfaces_at_that_call_and_later_chunks_are_not_sent():
    trainer = _model(_qwen2(), 3)
    info = refit_info(trainer, torch.bfloat16)
    calls = []

    class Engine:
        def update_weights_from_tensor(self, **kwargs):
            calls.append(kwargs["flush_cache"])
            return {"success": len(calls) < 2, "message": "engine out of memory"}

    with pytest.raises(
        RefitError, match="engine 0 rejected weight update call 1: engine out of memory"
    ):
        S.update_weights_to_sglang_colocated(
            params_generator(trainer, torch.bfloat16),
            rollout_engines=[Engine()],
            buffer_size_bytes=2048,
            num_gpus_per_engine=1,
        )
    assert calls == [False, False]
    engine_model = _model(_qwen2(), 4).to(torch.bfloat16)
    adapter = S.SGLangReceiverAdapter(engine_model, refit_info=info, atomic=True)
    before = _logprobs(engine_model)
    good = [
        (n, t)
        for n, t in params_generator(trainer, torch.bfloat16)
        if n == "model.embed_tokens.weight"
    ]
    bad = [("model.norm.weight", torch.ones(5, dtype=torch.bfloat16))]
    first = adapter.update_weights_from_tensor(
        serialized_named_tensors=[S.serialize_payload(S.flatten_bucket(good))],
        load_format="flattened_bucket",
        flush_cache=False,
    )
    second = adapter.update_weights_from_tensor(
        serialized_named_tensors=[S.serialize_payload(S.flatten_bucket(bad))],
        load_format="flattened_bucket",
        flush_cache=True,
    )
    assert first["success"] and not second["success"] and "'model.norm.weight'" in second["message"]
    assert (
        torch.equal(_logprobs(engine_model), before) and adapter.receiver.version == 0
    )  # atomic: old version serves


def test_argument_errors_are_raised_before_anything_is_sent():
    calls = []

    class Engine:
        def update_weights_from_tensor(self, **kwargs):
            calls.append(kwargs)
            return {"success": True}

    pairs = [("a", torch.ones(2))]
    cases = [
        (dict(sglang_quantization_cfg={"fp8": True}), "sglang_quantization_cfg is not supported"),
        (dict(target_precision="int3"), "int3"),
        (dict(buffer_size_bytes=0), "buffer_size_bytes 0 must be an int > 0"),
        (dict(num_gpus_per_engine=None), r"call set_rollout_num_gpus_per_engine\(n\)"),
        (
            dict(num_gpus_per_engine=3, world_size=4),
            "must be a positive int dividing the trainer world size 4",
        ),
        (dict(rollout_engines=[Engine(), Engine()]), "rollout_engines has 2 engine"),
    ]
    for overrides, match in cases:
        kwargs = (
            dict(rollout_engines=[Engine()], buffer_size_bytes=100, num_gpus_per_engine=1)
            | overrides
        )
        with pytest.raises(ValueError, match=match):
            S.update_weights_to_sglang_colocated(pairs, **kwargs)
    assert calls == []
    with pytest.raises(ValueError, match="dividing the trainer world size 2"):
        S.SGLangColocatedSender(rank=0, world_size=2).set_rollout_num_gpus_per_engine(3)


def test_the_adapter_refuses_payloads_with_globals_outside_the_allowlist():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    data = pickle.dumps({"flattened_tensor": [1.0], "metadata": [Evil()]})
    with pytest.raises(RefitError, match="builtins.print, which is not allowed"):
        S.deserialize_payload(data)
    adapter = S.SGLangReceiverAdapter(
        lambda pairs: None, refit_info={"a": (torch.Size([1]), torch.float32)}
    )
    reply = adapter.update_weights_from_tensor(
        serialized_named_tensors=[data], load_format="flattened_bucket"
    )
    assert not reply["success"] and "not allowed" in reply["message"]


def test_payload_metadata_reads_by_attribute_like_sglang():
    pairs = [
        ("w", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)),
        ("s", torch.tensor(2.0, dtype=torch.bfloat16)),
    ]
    payload = S.deserialize_payload(S.serialize_payload(S.flatten_bucket(pairs)))
    meta = payload["metadata"]
    assert all(isinstance(m, types.SimpleNamespace) for m in meta)
    assert [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in meta] == [
        ("w", (2, 3), torch.bfloat16, 0, 6, 6),
        ("s", (), torch.bfloat16, 6, 7, 1),
    ]
    byte_bucket = {
        "flattened_tensor": payload["flattened_tensor"].view(
            torch.uint8
        ),  # multi-dtype (byte) layout
        "metadata": [
            types.SimpleNamespace(
                name=m.name,
                shape=m.shape,
                dtype=m.dtype,
                start_idx=2 * m.start_idx,
                end_idx=2 * m.end_idx,
                numel=2 * m.numel,
            )
            for m in meta
        ],
    }
    for got in (S.unflatten_bucket(payload), S.unflatten_bucket(byte_bucket)):
        assert all(n == m and torch.equal(a, b) for (n, a), (m, b) in zip(got, pairs, strict=True))


@settings(max_examples=60)
@given(sizes=st.lists(st.integers(0, 300), max_size=20), limit=st.integers(1, 600))
def test_chunks_keep_order_and_close_before_reaching_the_limit(sizes, limit):
    chunks = S.plan_sglang_chunks(sizes, limit)
    streamed = S._iter_chunks(
        [(str(i), torch.empty(n, dtype=torch.uint8)) for i, n in enumerate(sizes)], limit
    )
    assert [
        [int(name) for name, _ in chunk] for chunk in streamed
    ] == chunks  # the lazy sender's chunks
    assert [i for c in chunks for i in c] == list(range(len(sizes)))
    for chunk in chunks:
        assert len(chunk) == 1 or sum(sizes[i] for i in chunk) < limit
    # a chunk closes only when the next tensor would reach the limit
    for a, b in itertools.pairwise(chunks):
        assert sum(sizes[i] for i in a) + sizes[b[0]] >= limit


def test_target_precision_aliases_match_the_dtype_table():
    assert precision_dtype("bf16") is torch.bfloat16 and precision_dtype("fp32") is torch.float32

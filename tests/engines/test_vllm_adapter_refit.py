"""One real vLLM engine with LoRA slots (CPU, fp32; ``enable_lora=True``, two slots) for three
ways an adapter reaches it: adapter-only refits over ZMQ, `VllmAdapterVersions` (PEFT folders),
and the Tinker-style `TrainingClient` sampling through `VllmSampler`.

Adapter-only refits share one LoRA worker: every test trains the worker a step (a fresh adapter's
``lora_B`` is zero: it would change nothing), refits the adapter alone with
``VllmRefit(lora=True)`` and reads vLLM's sampled-token logprobs against the worker's own fp32
forward of base + adapter (``get_logprobs``). Versions are relative to the shared refit, so the
order of these tests does not matter. The `VllmAdapterVersions` and `TrainingClient` tests, after
them, number their versions from 1: each starts on an engine with no adapter loaded and an empty
prefix cache (``fresh_llm``), as on an engine of its own. The base weights never move.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.engines.vllm_helpers import PROMPTS, TINY_LLAMA, engine, require_vllm, tiny_model

require_vllm()

from policyworker.demo.options import LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.errors import RefitError  # noqa: E402
from policyworker.functional.loss import NLLLoss  # noqa: E402
from policyworker.shell.engines.vllm import VllmRefit, _lora_init  # noqa: E402
from policyworker.shell.engines.vllm_lora import VllmAdapterVersions  # noqa: E402
from policyworker.shell.engines.vllm_lora_worker import (  # noqa: E402
    mismatched_lora_shapes,
    unreachable_lora_modules,
)
from policyworker.shell.refit import adapter_refit  # noqa: E402
from policyworker.shell.worker.policy_worker import PolicyWorker  # noqa: E402
from policyworker.training_client import (  # noqa: E402
    AdamParams,
    Datum,
    ModelInput,
    TrainingClient,
)
from policyworker.training_client import SamplingParams as ClientSamplingParams  # noqa: E402
from policyworker.training_client.vllm_sampler import VllmSampler  # noqa: E402
from tests.shell.conftest import make_batch, make_config  # noqa: E402

pytestmark = pytest.mark.slow

LORA = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 4, "alpha": 8}
TOLERANCE = max(LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    model_dir = tmp_path_factory.mktemp("vllm_adapter_refit") / "model"
    tiny_model(LlamaConfig(**TINY_LLAMA), seed=0).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def llm(model_dir):
    with engine(str(model_dir), enable_lora=True, max_lora_rank=8, max_loras=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def setup(model_dir, llm):
    _as_new(llm)
    torch.manual_seed(0)
    worker = PolicyWorker(
        make_config(str(model_dir), dtensor_cfg={"lora_cfg": LORA}), init_reference_model=False
    )
    yield llm, worker, VllmRefit(llm, worker, lora=True, keep=1)
    worker.shutdown()


def _as_new(llm) -> None:
    """Leave the engine as one of its own starts: no adapter loaded (each user of the engine
    numbers its versions, the adapters' ids, from 1) and no cached KV blocks."""
    for lora_id in llm.llm_engine.list_loras():
        assert llm.llm_engine.remove_lora(lora_id)
    assert llm.reset_prefix_cache()


@pytest.fixture
def fresh_llm(llm):
    """The module's engine as new, for a test that builds its own versions. The adapter-only
    refit tests come first in this file: their shared refit's adapter is removed here."""
    _as_new(llm)
    return llm


def _params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )


def _completion(output) -> tuple[list[int], list[float]]:
    ids = list(output.outputs[0].token_ids)
    return ids, [d[t].logprob for d, t in zip(output.outputs[0].logprobs, ids, strict=True)]


def _generate(llm, request, prompts=PROMPTS, *, max_tokens: int = 5):
    outs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts],
        _params(max_tokens),
        use_tqdm=False,
        lora_request=request,
    )
    return [_completion(o) for o in outs]


def _worst_mismatch(worker, prompts, outs) -> float:
    """The largest |vLLM - worker| logprob of the sampled tokens (worker: fp32 base + adapter)."""
    worst = 0.0
    for prompt, (tokens, logprobs) in zip(prompts, outs, strict=True):
        ids = torch.tensor([list(prompt) + tokens])
        data = {"input_ids": ids, "input_lengths": torch.tensor([ids.shape[1]])}
        lp = worker.get_logprobs(data)["logprobs"][0, len(prompt) :]
        worst = max(worst, float((lp - torch.tensor(logprobs)).abs().max()))
    return worst


def _train(worker, seed: int) -> None:
    worker.train(make_batch(4, 10, seed=seed), NLLLoss())


def test_an_adapter_only_refit_makes_vllm_serve_base_plus_adapter(setup):
    llm, worker, refit = setup
    _train(worker, seed=1)
    report = refit.refit()
    request = report["lora_request"]
    assert request.lora_int_id == refit.version and refit.adapters.current is request
    adapter_bytes = sum(
        s.numel() * 4 for s, _ in worker.prepare_refit_info(adapter_only=True).values()
    )
    assert report["engine_receive"]["num_bytes"] == adapter_bytes
    served = _generate(llm, request)
    assert _worst_mismatch(worker, PROMPTS, served) <= TOLERANCE
    assert served != _generate(llm, None)  # the adapter really changes what vLLM samples
    assert set(llm.llm_engine.list_loras()) == {refit.version}  # keep=1: the older ones are gone


def test_a_request_in_flight_finishes_on_its_version_while_new_ones_take_the_next(setup):
    llm, worker, refit = setup
    _train(worker, seed=2)
    old = refit.refit()["lora_request"]
    prompt, max_tokens = PROMPTS[0], 24
    (reference,) = _generate(llm, old, [prompt], max_tokens=max_tokens)
    assert _worst_mismatch(worker, [prompt], [reference]) <= TOLERANCE
    engine, params, last = llm.llm_engine, _params(max_tokens), {}

    def step() -> None:
        for out in engine.step():
            last[out.request_id] = out

    with refit.adapters.hold() as held:
        assert held is old
        engine.add_request("on-old", {"prompt_token_ids": list(prompt)}, params, lora_request=old)
        for _ in range(3):
            step()
        assert not last["on-old"].finished  # the refit lands mid-request
        _train(worker, seed=3)
        new = refit.refit()["lora_request"]
        assert refit.adapters.loaded_versions == [old.lora_int_id, new.lora_int_id]
        engine.add_request("on-new", {"prompt_token_ids": list(prompt)}, params, lora_request=new)
        for _ in range(4 * max_tokens):
            if len(last) == 2 and all(out.finished for out in last.values()):
                break
            step()
    tokens, logprobs = _completion(last["on-old"])
    assert tokens == reference[0]
    torch.testing.assert_close(
        torch.tensor(logprobs), torch.tensor(reference[1]), rtol=0, atol=TOLERANCE
    )
    on_new = _completion(last["on-new"])
    assert _worst_mismatch(worker, [prompt], [on_new]) <= TOLERANCE
    assert on_new != (tokens, logprobs)
    assert refit.adapters.loaded_versions == [new.lora_int_id]  # released: evicted
    assert set(llm.llm_engine.list_loras()) == {new.lora_int_id}


def test_a_killed_adapter_refit_leaves_the_version_serving_and_the_next_one_works(
    setup, monkeypatch
):
    llm, worker, refit = setup
    _train(worker, seed=4)
    serving = refit.refit()["lora_request"]
    served = _generate(llm, serving)
    walk = adapter_refit.adapter_stream

    def dies_after_three(model, *, dtype, cache=None):
        stream = walk(model, dtype=dtype, cache=cache)

        def sources():
            for count, source in enumerate(stream.sources):
                if count == 3:
                    raise RuntimeError("trainer died mid-refit")
                yield source

        return attrs.evolve(stream, sources=sources(), plain=None)  # read through sources

    monkeypatch.setattr(adapter_refit, "adapter_stream", dies_after_three)
    _train(worker, seed=5)
    with pytest.raises(RefitError, match=f"keeps serving version {serving.lora_int_id}") as info:
        refit.refit(buffer_size_bytes=2048)  # small buckets: some reached vLLM before the death
    assert "trainer died mid-refit" in str(info.value)
    assert refit.version == serving.lora_int_id
    assert set(llm.llm_engine.list_loras()) == {serving.lora_int_id}  # nothing registered
    assert _generate(llm, serving) == served  # bit for bit the version before
    monkeypatch.setattr(adapter_refit, "adapter_stream", walk)
    after = refit.refit()["lora_request"]
    assert after.lora_int_id == serving.lora_int_id + 1
    assert _worst_mismatch(worker, PROMPTS, _generate(llm, after)) <= TOLERANCE


def test_an_adapter_vllm_cannot_serve_is_refused_at_connect_and_the_refit_keeps_working(setup):
    llm, worker, refit = setup
    init = _lora_init(worker, 30.0)
    info = init["refit_info"]
    q_a = next(n for n in info if "q_proj.lora_A" in n)
    refusals = {
        "in_features=128": {**init, "refit_info": {**info, q_a: [[4, 64], "float32"]}},
        "reach no LoRA layer": {
            **init,
            "refit_info": {n.replace("down_proj", "no_such_proj"): v for n, v in info.items()},
        },
        "max_lora_rank": {**init, "peft_config": {**init["peft_config"], "r": 16}},
    }
    for words, bad in refusals.items():
        with pytest.raises(Exception, match=words):
            llm.collective_rpc("policyworker_connect_lora", args=(bad,))
    with pytest.raises(ValueError, match="lora=True takes 'extension' only"):
        VllmRefit(llm, worker, lora=True, via="weight_transfer")
    with pytest.raises(ValueError, match="max_cpu_loras=2"):  # 2 kept + 1 arriving > 2 slots
        VllmRefit(llm, worker, lora=True, keep=2)
    _train(worker, seed=6)  # the refused connects left the connected refit as it was
    request = refit.refit()["lora_request"]
    assert _worst_mismatch(worker, PROMPTS, _generate(llm, request)) <= TOLERANCE


def test_the_reachability_and_shape_rules_name_each_offending_tensor():
    prefix = "base_model.model.model.layers.0."
    q_a, down_a = f"{prefix}self_attn.q_proj.lora_A.weight", f"{prefix}mlp.down_proj.lora_A.weight"
    q_b = f"{prefix}self_attn.q_proj.lora_B.weight"
    packed = {"model.layers.0.self_attn.qkv_proj": ["model.layers.0.self_attn.q_proj"]}
    missing = unreachable_lora_modules(
        [q_a, down_a], ["model.layers.0.mlp.gate_up_proj"], packed, None
    )
    assert missing == [down_a]
    dims = {"model.layers.0.self_attn.q_proj": (128, 256)}
    info = {q_a: ((4, 128), None), q_b: ((128, 4), None), down_a: ((4, 7), None)}
    assert mismatched_lora_shapes(info, dims, None) == [
        f"{q_b}: [128, 4], vLLM's layer has out_features=256"
    ]


def test_published_adapter_versions_serve_the_worker_and_old_ones_are_evicted(
    fresh_llm, model_dir, tmp_path
):
    llm = fresh_llm
    torch.manual_seed(0)
    cfg = make_config(str(model_dir), dtensor_cfg={"lora_cfg": LORA})
    worker = PolicyWorker(cfg, init_reference_model=False)
    versions = VllmAdapterVersions(llm, worker, root=tmp_path / "adapters", keep=1)
    worker.train(make_batch(4, 10, seed=1), NLLLoss())
    first = versions.publish()
    with versions.hold() as held:  # a request in flight on version 1
        v1_outs = _generate(llm, held)
        assert _worst_mismatch(worker, PROMPTS, v1_outs) <= TOLERANCE
        for seed in (2, 3):
            worker.train(make_batch(4, 10, seed=seed), NLLLoss())
        second = versions.publish()
        assert versions.loaded_versions == [1, 2]  # held: not evicted
        assert _generate(llm, first) == v1_outs  # version 1 still serves as it did
    assert versions.loaded_versions == [2]
    assert not (tmp_path / "adapters" / "v1").exists()
    v2_outs = _generate(llm, second)
    assert _worst_mismatch(worker, PROMPTS, v2_outs) <= TOLERANCE
    assert v2_outs != v1_outs
    worker.shutdown()


def test_a_grpo_loop_samples_from_vllm_with_each_new_adapter_version(
    fresh_llm, model_dir, tmp_path
):
    """The Tinker-style `TrainingClient`, a 2-step GRPO loop: every `save_weights_for_sampler`
    becomes a new LoRA version of the engine."""
    llm = fresh_llm
    torch.manual_seed(0)
    worker = PolicyWorker(
        make_config(str(model_dir), dtensor_cfg={"lora_cfg": LORA}), init_reference_model=False
    )
    prompt = ModelInput.from_ints([3, 17, 42, 9])
    sampler = VllmSampler(llm)
    client = TrainingClient(worker, sampler=sampler, root=tmp_path / "run")
    for step in range(2):
        params = ClientSamplingParams(max_tokens=4, temperature=1.0, seed=step)
        sequences = client.sample(prompt, 4, params).result().sequences
        rewards = torch.tensor([sum(t < 64 for t in s.tokens) / 4 for s in sequences])
        data = []
        for seq, adv in zip(sequences, (rewards - rewards.mean()).tolist(), strict=True):
            tokens = prompt.to_ints() + seq.tokens
            pad = [0.0] * (prompt.length - 1)
            data.append(
                Datum(
                    model_input=ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "weights": pad + [1.0] * len(seq.tokens),
                        "logprobs": pad + seq.logprobs,
                        "advantages": pad + [adv] * len(seq.tokens),
                    },
                )
            )
        result = client.forward_backward(data, "importance_sampling").result()
        for datum, out in zip(data, result.loss_fn_outputs, strict=True):
            sampled = torch.tensor(datum.loss_fn_inputs["weights"]) > 0
            sampler_lp = torch.tensor(datum.loss_fn_inputs["logprobs"])[sampled]
            # on-policy: vLLM sampled with the adapter the learner has
            assert float((out["logprobs"][sampled] - sampler_lp).abs().max()) <= TOLERANCE
        client.optim_step(AdamParams(learning_rate=5e-2, beta2=0.999, eps=1e-8))
        client.save_weights_for_sampler(f"step-{step}")
        assert sampler.versions.version == step + 1
    worker.shutdown()

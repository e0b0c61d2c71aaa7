"""A real vLLM engine (CPU, fp32, in this process) refit from our trainer side, and the same
engine hosting the rollout side of a checkpoint-engine refit.

One engine for the module (a start costs 15-60 s on 2 cores); each test connects its own sender
(``VllmRefit`` re-initialises the backend), so the order of the tests does not matter. The
checkpoint-engine test needs an engine no one handed checkpoint-engine refit info yet: no other
test here does (``VllmRefit`` never calls ``checkpoint_engine_set_refit_info``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import attrs
import pytest
import torch

from tests.engines.vllm_helpers import (
    PROMPTS,
    TINY_LLAMA,
    engine,
    generate,
    hf_continuation,
    require_vllm,
    tiny_model,
)

require_vllm()

from policyworker.demo.options import VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.errors import RefitError  # noqa: E402
from policyworker.functional.loss import NLLLoss  # noqa: E402
from policyworker.shell.engines.vllm import VllmRefit, encode_refit_info  # noqa: E402
from policyworker.shell.refit.sender import RefitSender  # noqa: E402
from policyworker.shell.worker.policy_worker import PolicyWorker  # noqa: E402
from tests.shell.conftest import make_batch, make_config  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("vllm_llama") / "model"
    tiny_model(LlamaConfig(**TINY_LLAMA), seed=0).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llm(model_dir):
    with engine(model_dir) as llm:
        yield llm


@pytest.fixture
def senders():
    """RefitSenders over HF models, closed after the test (an open ZMQ socket would make its
    context's garbage collection block)."""
    made = []

    def make(model: torch.nn.Module) -> RefitSender:
        made.append(RefitSender(lambda: model, torch.float32))
        return made[-1]

    yield make
    for sender in made:
        sender.close()


def _other_model(model_dir: str, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig

    return tiny_model(AutoConfig.from_pretrained(model_dir), seed)


def _assert_vllm_serves(llm, model: torch.nn.Module, *, max_tokens: int = 6) -> list:
    """vLLM's greedy tokens equal the HF model's argmax, its logprobs the HF fp32 logprobs."""
    outs = generate(llm, PROMPTS, max_tokens=max_tokens)
    for prompt, (tokens, logprobs) in zip(PROMPTS, outs, strict=True):
        greedy, hf_lp = hf_continuation(model, prompt, tokens)
        assert tokens == greedy
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(hf_lp), rtol=0, atol=VLLM_FP32_TOLERANCE
        )
    return outs


@pytest.mark.parametrize("via", ["weight_transfer", "extension"])
def test_refit_makes_vllm_generate_exactly_what_hf_generates_with_the_same_weights(
    llm, model_dir, senders, via
):
    model = _other_model(model_dir, seed=11 if via == "weight_transfer" else 12)
    before = generate(llm, PROMPTS, max_tokens=6)
    refit = VllmRefit(llm, senders(model), via=via)
    report = refit.refit()
    assert report["version"] == 1 and report["num_tensors"] == len(model.state_dict())
    assert _assert_vllm_serves(llm, model) != before  # the engine really changed weights


def test_a_refit_that_fails_midway_leaves_vllm_serving_the_previous_weights(
    llm, model_dir, senders
):
    old, new = _other_model(model_dir, seed=21), _other_model(model_dir, seed=22)
    VllmRefit(llm, senders(old)).refit()
    served = _assert_vllm_serves(llm, old)

    def dies_after_ten(sources):
        for count, source in enumerate(sources):
            if count == 10:
                raise RuntimeError("trainer died mid-refit")
            yield source

    sender = senders(new)
    walk = sender.weight_stream
    sender.weight_stream = lambda: attrs.evolve(
        (stream := walk()), sources=dies_after_ten(stream.sources), plain=None
    )
    refit = VllmRefit(llm, sender)
    with pytest.raises(RefitError, match="keeps serving version 0") as info:
        # small buffers: several buckets have reached vLLM's worker before the failure
        refit.refit(buffer_size_bytes=256 << 10)
    del sender.weight_stream  # the next refit streams the whole model again
    assert "trainer died mid-refit" in str(info.value)
    assert generate(llm, PROMPTS, max_tokens=6) == served  # bit for bit the old version
    # The next complete refit goes through at once (no staging file gone, no stale ABORT).
    version = refit.refit()["version"]
    assert version == 1
    _assert_vllm_serves(llm, new)


def test_a_version_vllm_cannot_load_is_rolled_back_to_the_previous_weights(llm, model_dir, senders):
    """vLLM processes each layer once its tensors arrived; a name it does not know, streamed
    after layer 0 is complete, must not leave layer 0 (and the embedding) on the new version."""
    old, new = _other_model(model_dir, seed=41), _other_model(model_dir, seed=42)
    VllmRefit(llm, senders(old)).refit()
    served = _assert_vllm_serves(llm, old)
    new.model.layers[1].mlp.register_parameter("not_in_vllm", torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(RefitError, match="not_in_vllm"):
        VllmRefit(llm, senders(new)).refit()
    assert generate(llm, PROMPTS, max_tokens=6) == served  # bit for bit the old version


@pytest.mark.parametrize("via", ["weight_transfer", "extension"])
def test_a_co_trained_draft_is_refused_by_an_engine_without_a_drafter(llm, model_dir, via):
    """draft.* tensors need vLLM's speculative drafter: without one, VllmRefit raises before
    anything connects, naming the tensors and the fix; the engine serves on."""
    from policyworker.shell.worker.draft import Eagle3Draft, _draft_config

    model = _other_model(model_dir, seed=51)
    draft = Eagle3Draft(_draft_config(model.config, 1), num_aux=2)
    served = generate(llm, PROMPTS, max_tokens=6)
    sender = RefitSender(lambda: model, torch.float32, draft_model_fn=lambda: draft)
    try:
        with pytest.raises(ValueError, match=r"draft\.\* tensor\(s\) .*draft\.fc\.weight") as info:
            VllmRefit(llm, sender, via=via)
    finally:
        sender.close()
    assert "no speculative drafter" in str(info.value)
    assert "speculative_config={'method': 'eagle3'" in str(info.value)
    assert generate(llm, PROMPTS, max_tokens=6) == served


def _mismatch(worker, llm, *, seed: int) -> tuple[float, float]:
    """(token_mult_prob_error, max |lp_train - lp_gen|) of vLLM samples scored by the worker."""
    from policyworker.demo.task import logprob_mismatch

    outs = generate(llm, PROMPTS, max_tokens=5, temperature=1.0, seed=seed)
    width = max(len(p) for p in PROMPTS) + 5
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.int64)
    gen = torch.zeros(len(PROMPTS), width)
    mask = torch.zeros(len(PROMPTS), width)
    lengths = []
    for row, (prompt, (tokens, logprobs)) in enumerate(zip(PROMPTS, outs, strict=True)):
        n = len(prompt) + len(tokens)
        ids[row, :n] = torch.tensor(prompt + tokens)
        gen[row, len(prompt) : n] = torch.tensor(logprobs)
        mask[row, len(prompt) : n] = 1
        lengths.append(n)
    data = {"input_ids": ids, "input_lengths": torch.tensor(lengths)}
    train = worker.get_logprobs(data)["logprobs"]
    return logprob_mismatch(train, gen, mask)


def test_train_then_refit_keeps_vllm_within_fp32_parity_of_get_logprobs(llm, model_dir):
    worker = PolicyWorker(make_config(model_dir), init_reference_model=False)
    assert worker.parallel.world_size == 1
    try:
        refit = VllmRefit(llm, worker)
        for step in range(2):
            worker.train(make_batch(4, 10, seed=step), NLLLoss())
            refit.refit()
            mult, worst = _mismatch(worker, llm, seed=step)
            print(f"train+refit {step}: token_mult_prob_error={mult:.9f} max_dlogp={worst:.3g}")
            assert worst <= VLLM_FP32_TOLERANCE
            assert 1.0 <= mult <= 1.0 + VLLM_FP32_TOLERANCE
    finally:
        worker.shutdown()


def test_a_lora_workers_merged_refit_reaches_vllm(llm, model_dir, senders):
    from policyworker.demo.options import LORA_FP32_TOLERANCE

    lora = {
        "lora_cfg": {
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "dim": 4,
            "alpha": 8,
            "match_all_linear": False,
        }
    }
    worker = PolicyWorker(make_config(model_dir, dtensor_cfg=lora), init_reference_model=False)
    try:
        for seed in range(2):
            worker.train(make_batch(4, 10, seed=seed), NLLLoss())
        assert not any("lora" in name for name in worker.prepare_refit_info())
        VllmRefit(llm, worker).refit()
        _, worst = _mismatch(worker, llm, seed=7)
        print(f"LoRA merged refit: max_dlogp={worst:.3g}")
        assert worst <= max(LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE)
        # the adapters moved the model: the base weights alone do not match
        VllmRefit(llm, senders(_other_model(model_dir, seed=0))).refit()
        _, worst_base = _mismatch(worker, llm, seed=7)
        assert worst_base > 100 * max(worst, 1e-6)
    finally:
        worker.shutdown()


# The checkpoint-engine rollout side: this process is the policy worker (NeMo-RL's
# ``checkpoint_engine_rpc`` lifecycle), vLLM's worker joins through ``collective_rpc`` and receives
# over the collective (gloo) backend.
CHECKPOINT_ENGINE = {
    "backend": "collective",
    "bucket_size_bytes": 64 << 10,
    "engine_kwargs": {"host": "127.0.0.1", "device": "cpu", "timeout_s": 60.0},
}


def rpc(worker, method, **kwargs):
    return asyncio.run(worker.checkpoint_engine_rpc(method, kwargs))


def vllm_rpc(llm, method, *args):
    return llm.collective_rpc("checkpoint_engine_rpc", args=(method, list(args)))


def test_checkpoint_engine_send_makes_vllms_logprobs_the_trainers(llm, model_dir):
    # vLLM re-raises a worker's error as a plain Exception carrying its text
    with pytest.raises(Exception, match="before checkpoint_engine_set_refit_info"):
        vllm_rpc(llm, "prepare_checkpoint_engine")
    worker = PolicyWorker(make_config(model_dir), init_reference_model=False)
    pool = ThreadPoolExecutor(1)  # vLLM's blocking calls, beside the policy side's
    try:
        worker._add_noise_to_weights()
        _, before = _mismatch(worker, llm, seed=0)
        assert before > 10 * VLLM_FP32_TOLERANCE  # vLLM serves other weights until the refit
        llm.collective_rpc(
            "checkpoint_engine_set_refit_info",
            args=(encode_refit_info(worker.prepare_refit_info()),),
        )
        rpc(worker, "init_checkpoint_engine", **CHECKPOINT_ENGINE)
        vllm_rpc(llm, "init_checkpoint_engine", *CHECKPOINT_ENGINE.values())
        metadata = [rpc(worker, "prepare_checkpoint_engine")]
        metadata += vllm_rpc(llm, "prepare_checkpoint_engine")  # one per vLLM worker
        assert len(metadata) == 2 and metadata[1]["rank"] == 0
        joined = pool.submit(
            vllm_rpc, llm, "init_checkpoint_engine_process_group", 0, 1, 1, metadata
        )
        rpc(
            worker,
            "init_checkpoint_engine_process_group",
            train_world_size=1,
            rollout_world_size=1,
            metadata=metadata,
        )
        assert joined.result(timeout=120) == [None]
        for version in (1, 2):
            got = pool.submit(vllm_rpc, llm, "update_weights_from_checkpoint_engine")
            rpc(worker, "send_weights_via_checkpoint_engine")
            assert got.result(timeout=120) == [True]
            report = llm.collective_rpc("checkpoint_engine_last_report")[0]
            assert report["version"] == version and report["num_buckets"] > 1
            _, worst = _mismatch(worker, llm, seed=version)
            assert worst <= VLLM_FP32_TOLERANCE, worst
            worker._add_noise_to_weights()
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        pool.submit(vllm_rpc, llm, "finalize_checkpoint_engine").result(timeout=60)
        pool.shutdown()
        worker.shutdown()

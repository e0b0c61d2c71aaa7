"""A refit in flight into a real ``AsyncLLM`` (CPU, fp32, its engine core in its own process):
the engine keeps generating while the trainer streams into the worker's staging, and runs the
swap between two of its steps. Which step that is, the engine decides: the per-request counts the
swap reports say where each request's tokens turned to the new version, and every token is
checked against the HF logprobs of its version: KV cache kept, KV recomputed, a refit killed
midway (the previous version keeps serving, the next refit works), and the demo's
``--engine vllm --async`` loop. One engine for the module, driven from one asyncio loop.
"""

from __future__ import annotations

import asyncio
import io
import re

import pytest
import torch

from tests.engines.vllm_helpers import (
    ENGINE_ENV,
    PROMPTS,
    TINY_LLAMA,
    hf_continuation,
    require_vllm,
    tiny_model,
)

require_vllm()

from policyworker.demo.options import VLLM_FP32_TOLERANCE, DemoOptions  # noqa: E402
from policyworker.demo.vllm_inflight_rollouts import EngineLoop, build_async_llm  # noqa: E402
from policyworker.shell.engines.vllm_inflight import VllmInflightRefit  # noqa: E402
from policyworker.shell.refit.sender import RefitSender  # noqa: E402

pytestmark = pytest.mark.slow
MAX_TOKENS = 400  # long enough that the swap lands while every request still decodes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("vllm_inflight_async") / "model"
    config = LlamaConfig(**{**TINY_LLAMA, "max_position_embeddings": 512})
    tiny_model(config, seed=0).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def engine(model_dir):
    """(the loop that owns it, the AsyncLLM): one engine for the whole module."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENGINE_ENV.items():
            mp.setenv(key, value)
        loop = EngineLoop()
        llm = loop.run(
            build_async_llm(
                model=model_dir,
                dtype="float32",
                enforce_eager=True,
                max_model_len=512,
                skip_tokenizer_init=True,
                seed=0,
                max_num_seqs=64,  # the demo's 64 rollouts of a step run at once
            ),
            timeout_s=900.0,
        )
        try:
            yield loop, llm
        finally:
            llm.shutdown()
            loop.close()


def _model(model_dir, seed):
    from transformers import AutoConfig

    return tiny_model(AutoConfig.from_pretrained(model_dir), seed)


def _failing_after(stream, buckets):
    """The sender's ``stream`` that dies after ``buckets`` buckets (a trainer killed mid-refit)."""

    def failing_stream(specs, plan, sources, **kwargs):
        def sources_then_fail():
            for _ in range(buckets):
                yield next(sources)
            raise OSError("trainer killed mid-refit")

        kwargs["plain"] = None  # read the tensors through the failing sources

        return original(specs, plan, sources_then_fail(), **kwargs)

    original = stream
    return failing_stream


async def _killed_refit(refit, seen):
    """A refit that dies midway while the engine generates: the reply that reports it, and the
    requests' token counts when it did."""
    zmq = refit.sender._zmq()
    original = zmq.stream
    zmq.stream = _failing_after(original, 4)
    try:
        with pytest.raises(OSError, match="killed mid-refit"):
            await asyncio.to_thread(refit.stage, buffer_size_bytes=1 << 16)
    finally:
        zmq.stream = original
    reply = {}
    for _ in range(500):  # the worker's thread notices the abort within its bounded waits
        reply = await refit.aswap()
        if reply["failures"]:
            break
        await asyncio.sleep(0.01)
    return reply, dict(seen)


async def _scenario(llm, old, new, *, tag="r", recompute_kv=False, kill=False):
    """Generate while a refit from ``old`` to ``new`` streams in (after one killed midway with
    ``kill``); (refit, the swap's reply, token counts when the stream began, final outputs,
    the killed refit's reply and the counts then, or None)."""
    from vllm import SamplingParams

    senders = [RefitSender(lambda: old, torch.float32), RefitSender(lambda: new, torch.float32)]
    try:
        first = VllmInflightRefit(llm, senders[0], timeout_s=30.0, connect=False)
        await first.aconnect()
        await asyncio.to_thread(first.stage)
        assert (await first.aswap())["version"] == 1  # the old weights serve
        await first.aclose()
        refit = VllmInflightRefit(llm, senders[1], timeout_s=30.0, connect=False)
        await refit.aconnect()
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, detokenize=False, ignore_eos=True
        )
        seen = {f"{tag}{i}": 0 for i in range(len(PROMPTS))}

        async def run(rid, prompt):
            final = None
            async for out in llm.generate({"prompt_token_ids": list(prompt)}, params, rid):
                seen[rid] = len(out.outputs[0].token_ids)
                final = out
            return final

        tasks = [asyncio.create_task(run(f"{tag}{i}", p)) for i, p in enumerate(PROMPTS)]
        while min(seen.values()) < 5:  # every request is decoding
            await asyncio.sleep(0.005)
        during = dict(seen)
        killed = await _killed_refit(refit, seen) if kill else None
        await asyncio.to_thread(refit.stage, buffer_size_bytes=1 << 16)  # generation goes on
        reply = await refit.aswap(recompute_kv=recompute_kv)
        finals = await asyncio.gather(*tasks)
        await refit.aclose()
        return refit, reply, during, finals, killed
    finally:
        for sender in senders:
            sender.close()


def _tokens(final):
    completion = final.outputs[0]
    ids = list(completion.token_ids)
    lps = torch.tensor([d[t].logprob for d, t in zip(completion.logprobs, ids, strict=True)])
    return ids, lps


def _cut(refit, rid, n):
    """Where request ``rid``'s tokens turn from version 0 to 1 (the swap's counts)."""
    versions = refit.token_versions(rid, n, added=0, finished=1)
    cut = versions.index(1)
    assert versions == [0] * cut + [1] * (n - cut)
    return cut


def _logprobs_of(model, prompt, ids):
    return torch.tensor(hf_continuation(model, prompt, ids)[1])


def test_async_llm_keeps_generating_through_a_refit_and_tags_every_token(engine, model_dir):
    loop, llm = engine
    old, new = _model(model_dir, 51), _model(model_dir, 52)
    refit, reply, during, finals, _ = loop.run(_scenario(llm, old, new), timeout_s=600.0)
    assert reply["swapped"]["version"] == 1 and reply["failures"] == 0
    for i, (prompt, final) in enumerate(zip(PROMPTS, finals, strict=True)):
        ids, lps = _tokens(final)
        cut = _cut(refit, f"r{i}", len(ids))
        assert during[f"r{i}"] <= cut < len(ids)  # the swap fell inside the generation
        hf_old = _logprobs_of(old, prompt, ids)
        torch.testing.assert_close(lps[:cut], hf_old[:cut], rtol=0, atol=VLLM_FP32_TOLERANCE)
        # new weights over the old version's cache: no longer the old version's tokens
        assert ((lps[cut:] - hf_old[cut:]).abs() > 1e-3).float().mean() > 0.9


def _exact_from(got, want):
    """The first index from which every ``got`` equals ``want`` within the vLLM tolerance."""
    close = (got - want).abs() <= VLLM_FP32_TOLERANCE
    start = len(got)
    while start > 0 and bool(close[start - 1]):
        start -= 1
    return start


def test_async_llm_refit_with_kv_recomputed_serves_the_new_version_exactly(engine, model_dir):
    loop, llm = engine
    old, new = _model(model_dir, 53), _model(model_dir, 54)
    refit, reply, during, finals, _ = loop.run(
        _scenario(llm, old, new, tag="rc", recompute_kv=True), timeout_s=600.0
    )
    assert reply["swapped"]["version"] == 1 and reply["failures"] == 0
    for i, (prompt, final) in enumerate(zip(PROMPTS, finals, strict=True)):
        ids, lps = _tokens(final)
        cut = _cut(refit, f"rc{i}", len(ids))
        assert during[f"rc{i}"] <= cut < len(ids)
        hf_old, hf_new = _logprobs_of(old, prompt, ids), _logprobs_of(new, prompt, ids)
        torch.testing.assert_close(lps[:cut], hf_old[:cut], rtol=0, atol=VLLM_FP32_TOLERANCE)
        # the scheduler was frozen from the swap to the preemption: no token saw the new
        # weights over the old cache; from the cut on, the new version exactly
        assert _exact_from(lps, hf_new) == cut


def test_async_llm_refit_killed_midway_keeps_the_previous_version_serving(engine, model_dir):
    loop, llm = engine
    old, new = _model(model_dir, 55), _model(model_dir, 56)
    refit, reply, during, finals, killed = loop.run(
        _scenario(llm, old, new, tag="k", kill=True), timeout_s=600.0
    )
    failed, at_failure = killed
    assert failed["failures"] == 1 and failed["swapped"] is None and failed["version"] == 0
    assert reply["swapped"]["version"] == 1 and reply["failures"] == 1  # the next refit works
    for i, (prompt, final) in enumerate(zip(PROMPTS, finals, strict=True)):
        ids, lps = _tokens(final)
        cut = _cut(refit, f"k{i}", len(ids))
        assert during[f"k{i}"] < at_failure[f"k{i}"] <= cut < len(ids)  # never stopped
        hf_old = _logprobs_of(old, prompt, ids)
        # every token up to the good refit's swap, through the failed one, is the old version's
        torch.testing.assert_close(lps[:cut], hf_old[:cut], rtol=0, atol=VLLM_FP32_TOLERANCE)
        assert ((lps[cut:] - hf_old[cut:]).abs() > 1e-3).float().mean() > 0.9


STEP_RE = re.compile(
    r"^step=(\d+) reward=([0-9.]+) kl=(-?[0-9.]+) refit_ms=([0-9.]+) max_dlogp=(\S+) "
    r"token_mult_prob_error=([0-9.]+)  lag max (\d+) mean ([0-9.]+)  stall ([0-9.]+) ms$"
)


def test_demo_with_vllm_async_checks_every_token_under_its_own_version(engine, monkeypatch):
    """``policyworker demo --engine vllm --async`` on this module's engine (``connect`` refits
    it to the demo's model first): generation runs while each refit streams, and every token's
    vLLM logprob equals the trainer's under that token's version."""
    from policyworker.demo import loop as demo_loop
    from policyworker.demo.task import TargetTokenTask
    from policyworker.demo.vllm_inflight_rollouts import VllmInflightRollouts

    engine_loop, llm = engine
    monkeypatch.setattr(
        demo_loop,
        "start_vllm",
        lambda model_dir, opts: VllmInflightRollouts(
            llm, engine_loop, timeout_s=opts.timeout_s, owns_engine=False
        ),
    )
    opts = DemoOptions(
        steps=3,
        seed=1,
        engine="vllm",
        inflight=True,
        require_rise=False,
        task=TargetTokenTask(vocab_size=TINY_LLAMA["vocab_size"]),  # this engine's vocabulary
    )
    out, err = io.StringIO(), io.StringIO()
    result = demo_loop.run_demo(opts, out=out, err=err)
    assert result.exit_code == 0, out.getvalue() + err.getvalue()
    steps = [STEP_RE.match(line) for line in out.getvalue().splitlines() if "step=" in line]
    assert len(steps) == 3 and all(steps), out.getvalue()
    for m in steps:
        assert float(m.group(5)) <= VLLM_FP32_TOLERANCE  # each token under its own version
        assert float(m.group(9)) > 0.0  # one swap per step, between two engine steps
    # each row's first token came before the refit streamed: the previous version's
    assert [int(m.group(7)) for m in steps] == [0, 1, 1]

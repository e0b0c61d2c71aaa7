"""A refit in flight into a real ``AsyncLLM`` (CPU, fp32, its engine core in its own process):
the engine keeps generating while the trainer streams into the worker's staging, and runs the
swap between two of its steps. Which step that is, the engine decides: the per-request counts the
swap reports say where each request's tokens turned to the new version, and every token is
checked against the HF logprobs of its version (KV cache kept).
"""

from __future__ import annotations

import asyncio

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

from policyworker.demo.options import VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.shell.engines.vllm import engine_kwargs  # noqa: E402
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
def async_llm(model_dir):
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENGINE_ENV.items():
            mp.setenv(key, value)
        args = AsyncEngineArgs(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            skip_tokenizer_init=True,
            seed=0,
            max_num_seqs=8,
            **engine_kwargs(),
        )
        llm = AsyncLLM.from_engine_args(args)
        try:
            yield llm
        finally:
            llm.shutdown()


def _model(model_dir, seed):
    from transformers import AutoConfig

    return tiny_model(AutoConfig.from_pretrained(model_dir), seed)


async def _scenario(llm, old, new):
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
        seen = {f"r{i}": 0 for i in range(len(PROMPTS))}

        async def run(i, prompt):
            final = None
            async for out in llm.generate({"prompt_token_ids": list(prompt)}, params, f"r{i}"):
                seen[f"r{i}"] = len(out.outputs[0].token_ids)
                final = out
            return final

        tasks = [asyncio.create_task(run(i, p)) for i, p in enumerate(PROMPTS)]
        while min(seen.values()) < 5:  # every request is decoding
            await asyncio.sleep(0.005)
        during = dict(seen)
        await asyncio.to_thread(refit.stage, buffer_size_bytes=1 << 16)  # generation goes on
        reply = await refit.aswap()
        finals = await asyncio.gather(*tasks)
        await refit.aclose()
        return refit, reply, during, finals
    finally:
        for sender in senders:
            sender.close()


def test_async_llm_keeps_generating_through_a_refit_and_tags_every_token(async_llm, model_dir):
    old, new = _model(model_dir, 51), _model(model_dir, 52)
    refit, reply, during, finals = asyncio.run(_scenario(async_llm, old, new))
    assert reply["swapped"]["version"] == 1 and reply["failures"] == 0
    for i, (prompt, final) in enumerate(zip(PROMPTS, finals, strict=True)):
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        lps = torch.tensor([d[t].logprob for d, t in zip(completion.logprobs, ids, strict=True)])
        versions = refit.token_versions(f"r{i}", len(ids), added=0, finished=1)
        cut = versions.index(1)
        assert versions == [0] * cut + [1] * (len(ids) - cut)
        assert during[f"r{i}"] <= cut < len(ids)  # the swap fell inside the generation
        _, hf_old = hf_continuation(old, prompt, ids)
        hf_old = torch.tensor(hf_old)
        torch.testing.assert_close(lps[:cut], hf_old[:cut], rtol=0, atol=VLLM_FP32_TOLERANCE)
        # new weights over the old version's cache: no longer the old version's tokens
        assert ((lps[cut:] - hf_old[cut:]).abs() > 1e-3).float().mean() > 0.9

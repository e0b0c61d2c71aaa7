"""Versioned LoRA adapters in a real vLLM engine (CPU, fp32): `VllmAdapterVersions`."""

from __future__ import annotations

import pytest
import torch

from tests.engines.vllm_helpers import PROMPTS, TINY_LLAMA, engine, require_vllm, tiny_model

require_vllm()

from policyworker.demo.options import LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.functional.loss import NLLLoss  # noqa: E402
from policyworker.shell.engines.vllm_lora import VllmAdapterVersions  # noqa: E402
from policyworker.shell.worker.policy_worker import PolicyWorker  # noqa: E402
from tests.shell.conftest import make_batch, make_config  # noqa: E402

pytestmark = pytest.mark.slow

LORA = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 4, "alpha": 8}


def _generate(llm, request, *, max_tokens: int = 5):
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )
    outs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in PROMPTS],
        params,
        use_tqdm=False,
        lora_request=request,
    )
    return [
        (
            list(o.outputs[0].token_ids),
            [
                d[t].logprob
                for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        )
        for o in outs
    ]


def _worst_mismatch(worker, outs) -> float:
    worst = 0.0
    for prompt, (tokens, logprobs) in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([list(prompt) + tokens])
        data = {"input_ids": ids, "input_lengths": torch.tensor([ids.shape[1]])}
        lp = worker.get_logprobs(data)["logprobs"][0, len(prompt) :]
        worst = max(worst, float((lp - torch.tensor(logprobs)).abs().max()))
    return worst


def test_published_adapter_versions_serve_the_worker_and_old_ones_are_evicted(tmp_path):
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    tiny_model(LlamaConfig(**TINY_LLAMA), seed=0).save_pretrained(model_dir)
    torch.manual_seed(0)
    cfg = make_config(str(model_dir), dtensor_cfg={"lora_cfg": LORA})
    worker = PolicyWorker(cfg, init_reference_model=False)
    with engine(str(model_dir), enable_lora=True, max_lora_rank=8, max_loras=2) as llm:
        versions = VllmAdapterVersions(llm, worker, root=tmp_path / "adapters", keep=1)
        worker.train(make_batch(4, 10, seed=1), NLLLoss())
        first = versions.publish()
        with versions.hold() as held:  # a request in flight on version 1
            v1_outs = _generate(llm, held)
            assert _worst_mismatch(worker, v1_outs) <= max(LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE)
            for seed in (2, 3):
                worker.train(make_batch(4, 10, seed=seed), NLLLoss())
            second = versions.publish()
            assert versions.loaded_versions == [1, 2]  # held: not evicted
            assert _generate(llm, first) == v1_outs  # version 1 still serves as it did
        assert versions.loaded_versions == [2]
        assert not (tmp_path / "adapters" / "v1").exists()
        v2_outs = _generate(llm, second)
        assert _worst_mismatch(worker, v2_outs) <= max(LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE)
        assert v2_outs != v1_outs
    worker.shutdown()

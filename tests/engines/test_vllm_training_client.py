"""The Tinker-style `TrainingClient` sampling through a real vLLM engine (CPU, fp32): a 2-step
GRPO loop where every `save_weights_for_sampler` becomes a new LoRA version of the engine."""

from __future__ import annotations

import pytest
import torch

from tests.engines.vllm_helpers import TINY_LLAMA, engine, require_vllm, tiny_model

require_vllm()

from policyworker.demo.options import LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.shell.worker.policy_worker import PolicyWorker  # noqa: E402
from policyworker.training_client import (  # noqa: E402
    AdamParams,
    Datum,
    ModelInput,
    SamplingParams,
    TrainingClient,
)
from policyworker.training_client.vllm_sampler import VllmSampler  # noqa: E402
from tests.shell.conftest import make_config  # noqa: E402

pytestmark = pytest.mark.slow

LORA = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 4, "alpha": 8}
TOLERANCE = max(LORA_FP32_TOLERANCE, VLLM_FP32_TOLERANCE)


def test_a_grpo_loop_samples_from_vllm_with_each_new_adapter_version(tmp_path):
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    tiny_model(LlamaConfig(**TINY_LLAMA), seed=0).save_pretrained(model_dir)
    torch.manual_seed(0)
    worker = PolicyWorker(
        make_config(str(model_dir), dtensor_cfg={"lora_cfg": LORA}), init_reference_model=False
    )
    prompt = ModelInput.from_ints([3, 17, 42, 9])
    with engine(str(model_dir), enable_lora=True, max_lora_rank=8, max_loras=2) as llm:
        sampler = VllmSampler(llm)
        client = TrainingClient(worker, sampler=sampler, root=tmp_path / "run")
        for step in range(2):
            params = SamplingParams(max_tokens=4, temperature=1.0, seed=step)
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

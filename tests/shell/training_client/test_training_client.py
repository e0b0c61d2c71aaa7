"""The Tinker-style `TrainingClient` over a LoRA `PolicyWorker` and an `HFSampler` (CPU, fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.model.lora import lora_state_dict
from policyworker.shell.worker.policy_worker import PolicyWorker
from policyworker.training_client import (
    AdamParams,
    Datum,
    HFSampler,
    ModelInput,
    SamplingParams,
    TrainingClient,
)
from policyworker.training_client.datums import to_batch
from tests.shell.conftest import VOCAB, make_config

LORA = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 4, "alpha": 8}
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _worker(path: str, **lora: object) -> PolicyWorker:
    torch.manual_seed(0)
    optimizer = {
        "name": "torch.optim.AdamW",
        "kwargs": {"lr": ADAM.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0},
    }
    cfg = make_config(path, dtensor_cfg={"lora_cfg": {**LORA, **lora}}, optimizer=optimizer)
    return PolicyWorker(cfg, init_reference_model=False)


def _copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items()}  # CPU state dicts are views


def _rollout_datum(prompt: ModelInput, tokens: list[int], logprobs: list[float], adv: float):
    seq = prompt.to_ints() + tokens
    pad = [0.0] * (prompt.length - 1)
    return Datum(
        model_input=ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={
            "target_tokens": seq[1:],
            "weights": pad + [1.0] * len(tokens),
            "logprobs": pad + logprobs,
            "advantages": pad + [adv] * len(tokens),
        },
    )


def test_a_three_step_grpo_loop_runs_end_to_end(tiny_model_paths, tmp_path):
    path = tiny_model_paths["llama"]
    worker = _worker(path)
    sampler = HFSampler(path)
    client = TrainingClient(worker, sampler=sampler, root=tmp_path)
    start = _copy(lora_state_dict(worker.model))
    prompts = [ModelInput.from_ints([3, 4, 7]), ModelInput.from_ints([9, 10, 11, 12])]
    for step in range(3):
        data = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=5, seed=10 * step + i)
            sequences = client.sample(prompt, 4, params).result().sequences
            # reward: the share of low token ids in the completion (a dense, learnable signal)
            rewards = torch.tensor([sum(t < VOCAB // 2 for t in s.tokens) / 5 for s in sequences])
            advantages = (rewards - rewards.mean()).tolist()
            for seq, adv in zip(sequences, advantages, strict=True):
                data.append(_rollout_datum(prompt, seq.tokens, seq.logprobs, adv))
        result = client.forward_backward(data, "importance_sampling").result()
        for datum, out in zip(data, result.loss_fn_outputs, strict=True):
            # on-policy: the learner scores the sampled tokens as the sampler did
            sampled = torch.tensor(datum.loss_fn_inputs["weights"]) > 0
            torch.testing.assert_close(
                out["logprobs"][sampled],
                torch.tensor(datum.loss_fn_inputs["logprobs"])[sampled],
                rtol=1e-4,
                atol=1e-4,
            )
        assert math.isfinite(result.metrics["loss:mean"])
        stepped = client.optim_step(ADAM).result()
        assert stepped.metrics["skipped_steps"] == 0 and stepped.metrics["grad_norm"] > 0
        saved = client.save_weights_for_sampler(f"step-{step}").result()
        assert sampler.adapter_path == saved.path
    trained = lora_state_dict(worker.model)
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    served = lora_state_dict(sampler.model)
    assert all(torch.equal(served[k], trained[k]) for k in trained)
    sampling = client.save_weights_and_get_sampling_client("final")
    again = sampling.sample(prompts[0], 2, SamplingParams(max_tokens=3, seed=5)).result()
    assert again == client.sample(prompts[0], 2, SamplingParams(max_tokens=3, seed=5)).result()


def _sft_data(n: int, seed: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen)
            for _ in range(n)]  # fmt: skip
    return [
        Datum(
            model_input=ModelInput.from_ints(s[:-1].tolist()),
            loss_fn_inputs={"target_tokens": s[1:], "weights": torch.ones(len(s) - 1)},
        )
        for s in seqs
    ]


def test_forward_backward_then_optim_step_is_the_worker_train_step(tiny_model_paths):
    path = tiny_model_paths["llama"]
    client = TrainingClient(_worker(path))
    direct = _worker(path)
    first, second = _sft_data(2, seed=1), _sft_data(2, seed=2)
    client.forward_backward(first, "cross_entropy")
    client.forward_backward(second, "cross_entropy")
    client.optim_step(ADAM)
    direct.train(to_batch(first + second), NLLLoss(), gbs=4)
    got, want = lora_state_dict(client.worker.model), lora_state_dict(direct.model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_save_state_then_load_state_restores_weights_and_optimizer(tiny_model_paths, tmp_path):
    client = TrainingClient(_worker(tiny_model_paths["llama"]), root=tmp_path)
    client.forward_backward(_sft_data(4, seed=1), "cross_entropy")
    client.optim_step(ADAM)
    path = client.save_state("one-step").result().path
    saved = _copy(lora_state_dict(client.worker.model))
    client.forward_backward(_sft_data(4, seed=2), "cross_entropy")
    client.optim_step(ADAM)
    moved = _copy(lora_state_dict(client.worker.model))
    assert any(not torch.equal(saved[k], moved[k]) for k in saved)
    client.load_state(path)
    loaded = lora_state_dict(client.worker.model)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    # the optimizer state came back too: the same next step as from the saved state
    client.forward_backward(_sft_data(4, seed=2), "cross_entropy")
    client.optim_step(ADAM)
    assert all(torch.equal(moved[k], v) for k, v in lora_state_dict(client.worker.model).items())


def test_two_clients_train_two_adapters_of_one_worker(tiny_model_paths, tmp_path):
    worker = _worker(tiny_model_paths["llama"], adapters=["a", "b"])
    clients = {n: TrainingClient(worker, adapter=n, root=tmp_path / n) for n in ("a", "b")}
    for seed, name in enumerate(("a", "b")):
        clients[name].forward_backward(_sft_data(4, seed=seed), "cross_entropy")
        clients[name].optim_step(ADAM)
    folders = {n: c.save_weights_for_sampler("w").result().path for n, c in clients.items()}
    files = {n: (tmp_path / n / "sampler_weights" / "w" / "adapter_model.safetensors").read_bytes()
             for n in folders}  # fmt: skip
    assert files["a"] != files["b"]


def test_bad_calls_are_refused_with_the_fix(tiny_model_paths):
    client = TrainingClient(_worker(tiny_model_paths["llama"]))
    with pytest.raises(ValueError, match="nothing to step on"):
        client.optim_step(ADAM)
    shifted_wrong = Datum(
        model_input=ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [5, 6, 7]}
    )
    with pytest.raises(ValueError, match="shifted by one"):
        client.forward_backward([shifted_wrong], "cross_entropy")
    with pytest.raises(ValueError, match="the names are"):
        client.forward_backward(_sft_data(2, seed=0), "dpo")
    with pytest.raises(ValueError, match=r"needs loss_fn_inputs \['logprobs', 'advantages'\]"):
        client.forward_backward(_sft_data(2, seed=0), "ppo")
    with pytest.raises(ValueError, match="needs a sampler"):
        client.sample(ModelInput.from_ints([3]))
    with pytest.raises(ValueError, match="needs a sampler"):
        client.save_weights_and_get_sampling_client("w")
    assert client.get_tokenizer() is client.worker.tokenizer

"""LoRA through the PolicyWorker.

The merged refit stream and the PEFT adapter folder reproduce the worker.
"""

from __future__ import annotations

import torch
import transformers

from policyworker.functional.loss import NLLLoss
from policyworker.shell.refit.weight_stream import params_generator
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config

LORA = {
    "lora_cfg": {
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "dim": 4,
        "alpha": 8,
        "match_all_linear": False,
    }
}


def _trained_lora_worker(model_path: str) -> PolicyWorker:
    worker = PolicyWorker(make_config(model_path, dtensor_cfg=LORA), init_reference_model=False)
    for seed in range(3):
        result = worker.train(make_batch(4, 10, seed=seed), NLLLoss())
        assert result["skipped_steps"] == 0
    modules = (worker.model.get_submodule(name) for name in worker.lora_module_names)
    adapters = [module.lora_B.weight for module in modules]
    assert any(bool(b.abs().sum() > 0) for b in adapters), "training must move lora_B off zero"
    return worker


def _logprobs(model: torch.nn.Module, data: dict) -> torch.Tensor:
    ids = data["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    valid = torch.arange(ids.shape[1])[None] < data["input_lengths"][:, None]
    return torch.where(valid, lp, torch.zeros_like(lp))


def test_hf_model_loading_the_merged_refit_stream_reproduces_the_lora_worker(tiny_model_paths):
    path = tiny_model_paths["llama"]
    worker = _trained_lora_worker(path)
    stream = dict(params_generator(worker.model, torch.float32))
    assert not any("lora" in name for name in stream)
    receiver = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    missing, unexpected = receiver.load_state_dict(stream, strict=False)
    assert not missing and not unexpected  # the tiny Llama is untied: every HF key is streamed
    data = make_batch(4, 10, seed=11)
    torch.testing.assert_close(
        _logprobs(receiver, data), worker.get_logprobs(data)["logprobs"], rtol=1e-5, atol=1e-5
    )


def test_peft_loading_the_saved_adapter_folder_gives_the_worker_logits(tiny_model_paths, tmp_path):
    from peft import PeftModel

    path = tiny_model_paths["llama"]
    worker = _trained_lora_worker(path)
    worker.save_checkpoint(str(tmp_path / "weights"), is_final_checkpoint=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "weights" / "model")).eval()
    data = make_batch(4, 10, seed=12)
    torch.testing.assert_close(
        _logprobs(peft_model, data), worker.get_logprobs(data)["logprobs"], rtol=1e-5, atol=1e-5
    )


def test_lora_cfg_compute_dtype_reaches_the_worker_adapters(tiny_model_paths):
    path = tiny_model_paths["llama"]
    auto = PolicyWorker(make_config(path, dtensor_cfg=LORA), init_reference_model=False)
    assert {auto.model.get_submodule(n).compute_dtype for n in auto.lora_module_names} == {
        torch.float32  # "auto" on CPU
    }
    forced = {"lora_cfg": {**LORA["lora_cfg"], "compute_dtype": "bfloat16"}}
    worker = PolicyWorker(make_config(path, dtensor_cfg=forced), init_reference_model=False)
    modules = [worker.model.get_submodule(n) for n in worker.lora_module_names]
    assert {m.compute_dtype for m in modules} == {torch.bfloat16}
    result = worker.train(make_batch(4, 10, seed=0), NLLLoss())
    assert result["skipped_steps"] == 0
    assert {m.lora_A.weight.dtype for m in modules} == {torch.float32}


def test_a_bf16_lora_worker_scores_like_an_engine_holding_its_refit_weights(tiny_model_paths):
    """Adapters in bf16 under bf16 autocast (the CUDA default) merge into the frozen weights for
    every layer, the chunked LM head included: the worker's logprobs equal those of a model
    holding the fp32 refit stream and running under the same autocast (its weights cast to the
    bf16 an engine receives), not merely come close."""
    path = tiny_model_paths["llama"]
    bf16 = {"lora_cfg": {**LORA["lora_cfg"], "target_modules": ["q_proj", "down_proj", "lm_head"]}}
    bf16["lora_cfg"]["compute_dtype"] = "bfloat16"
    worker = PolicyWorker(
        make_config(path, dtensor_cfg=bf16, precision="bfloat16"), init_reference_model=False
    )
    for seed in range(2):
        assert worker.train(make_batch(4, 10, seed=seed), NLLLoss())["skipped_steps"] == 0
    stream = dict(params_generator(worker.model, torch.float32))
    engine = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine.load_state_dict(stream, strict=True)
    data = make_batch(4, 10, seed=13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _logprobs(engine, data)
    got = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

"""Reference-model swap and the offload state machine of PolicyWorker (CPU)."""

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.worker.policy_worker import AutomodelPolicyWorker, PolicyWorker
from tests.shell.conftest import hf_reference_logprobs, make_batch, make_config


@pytest.fixture
def trained(tiny_model_paths):
    """A worker whose weights moved away from the initial (reference) weights, and its batch."""
    path = tiny_model_paths["qwen3"]
    worker = PolicyWorker(
        make_config(path, generation={"temperature": 1.5, "top_k": 3, "top_p": 0.9})
    )
    data = make_batch(4, 10, seed=21)
    worker.train(data, NLLLoss())
    return worker, data, path


def test_reference_logprobs_equal_initial_model_with_filters_off_and_temperature_kept(trained):
    worker, data, path = trained
    ref = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert torch.allclose(ref, hf_reference_logprobs(path, data, temperature=1.5))
    with worker.use_reference_model():
        assert worker._sampling == (1.5, None, 1.0)
    assert worker._sampling == (1.5, 3, 0.9)


def test_exception_inside_reference_block_restores_trained_weights(trained):
    worker, data, _ = trained
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), worker.use_reference_model():
        raise RuntimeError("boom")
    after = worker.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert worker._sampling == (1.5, 3, 0.9)


def test_reference_model_needs_init_reference_model(tiny_model_paths):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    with pytest.raises(ValueError, match="init_reference_model"), worker.use_reference_model():
        pass


def test_offload_state_machine_on_cpu(tiny_model_paths):
    """Modes and devices follow reference §13; 'cuda' means the worker's device on CPU."""
    cfg = make_config(tiny_model_paths["llama"], offload_optimizer_for_logprob=True)
    worker = AutomodelPolicyWorker(cfg, init_reference_model=False)
    data = make_batch(4, 8, seed=22)
    worker.prepare_for_training()
    assert worker.model.training
    worker.train(data, NLLLoss())
    params = list(worker.model.parameters())
    worker.offload_before_refit()
    worker.offload_after_refit()
    assert not worker.model.training
    assert all(p.device.type == "cpu" for p in worker.model.parameters())
    assert all(b.device.type == "cpu" for b in worker.model.buffers())
    worker.prepare_for_lp_inference()
    assert not worker.model.training
    lp = worker.get_logprobs(data)["logprobs"]
    worker.prepare_for_training()
    assert worker.model.training
    # parameters are the same objects, so the optimizer still drives the live model
    assert [id(p) for p in worker.model.parameters()] == [id(p) for p in params]
    assert all(
        v.device == worker.device
        for s in worker.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    worker.move_optimizer_to_device("cuda")
    worker.move_to_cuda(worker.model)
    worker.finish_inference()
    worker.prepare_for_lp_inference(keep_train_buffers=True)
    assert torch.equal(worker.get_logprobs(data)["logprobs"], lp)
    assert worker.train(data, NLLLoss())["skipped_steps"] == 0


def test_misc_methods(tiny_model_paths):
    worker = PolicyWorker(make_config(tiny_model_paths["qwen2"]), init_reference_model=False)
    assert repr(worker).startswith(f"PolicyWorker(model={tiny_model_paths['qwen2']!r}, ")
    assert "dp×cp×tp=1×1×1, rank=0/1" in repr(worker)
    assert worker.return_model_config() is worker.model.config
    assert worker.return_model_config().use_cache is False
    sd = worker.return_state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    worker._add_noise_to_weights()
    changed = [k for k in before if not torch.equal(before[k], worker.model.state_dict()[k])]
    assert "model.embed_tokens.weight" in changed
    assert worker.shutdown() is True


def test_lora_worker_trains_only_adapters_and_refit_info_has_hf_names(tiny_model_paths):
    cfg = make_config(
        tiny_model_paths["llama"],
        precision="bfloat16",
        dtensor_cfg={
            "lora_cfg": {
                "target_modules": ["q_proj", "v_proj"],
                "dim": 4,
                "match_all_linear": False,
            }
        },
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    assert len(worker.lora_module_names) == 4
    trainable = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    base = {k: v.clone() for k, v in worker.model.state_dict().items() if ".lora_" not in k}
    worker.train(make_batch(4, 8, seed=23), NLLLoss())
    assert all(torch.equal(base[k], worker.model.state_dict()[k]) for k in base)
    info = worker.prepare_refit_info()
    assert "model.layers.0.self_attn.q_proj.weight" in info
    assert not any("lora" in name for name in info)
    assert {dtype for _, dtype in info.values()} == {torch.bfloat16}


def test_constructor_resumes_weights_and_optimizer_from_a_checkpoint(tiny_model_paths, tmp_path):
    cfg = make_config(tiny_model_paths["qwen2"])
    data = make_batch(4, 8, seed=24)
    first = PolicyWorker(cfg)
    first.train(data, NLLLoss())
    first.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"), is_final_checkpoint=True)
    first.finalize_async_save()
    resumed = PolicyWorker(
        cfg, weights_path=str(tmp_path / "w"), optimizer_path=str(tmp_path / "o")
    )
    for name, value in first.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert torch.equal(
        first.train(data, NLLLoss())["global_loss"], resumed.train(data, NLLLoss())["global_loss"]
    )

"""Adapter-only refits: the LoRA tensors alone, under PEFT's names, into a PEFT-wrapped HF model
through `HFWeightReceiver` (ZMQ over shared memory on the CPU; the receiver in a thread)."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from policyworker.functional.loss import NLLLoss
from policyworker.shell.model.peft_adapter import save_peft_adapter
from policyworker.shell.refit.adapter_refit import peft_load_weights
from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config

LORA = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 4, "alpha": 8}


def _logprobs(model: torch.nn.Module, data: dict) -> torch.Tensor:
    ids = data["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    valid = torch.arange(ids.shape[1])[None] < data["input_lengths"][:, None]
    return torch.where(valid, lp, torch.zeros_like(lp))


def _engine(path: str, worker: PolicyWorker, folder) -> torch.nn.Module:
    """The engine's model: the base wrapped with the worker's adapter as it is now (PEFT)."""
    from peft import PeftModel

    save_peft_adapter(worker.model, folder, lora_cfg=worker.cfg.dtensor_cfg.lora_cfg)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(folder)).eval()


def _refit(worker: PolicyWorker, receiver: HFWeightReceiver) -> tuple[dict, RefitReport]:
    got: dict[str, RefitReport] = {}
    thread = threading.Thread(target=lambda: got.update(report=receiver.receive()), daemon=True)
    thread.start()
    report = worker.stream_weights_via_ipc_zmq(timeout_s=30, adapter_only=True)
    thread.join(timeout=30)
    assert not thread.is_alive() and report is not None
    return report, got["report"]


def test_adapter_only_refits_bring_a_peft_engine_to_the_worker_version_by_version(
    tiny_model_paths, tmp_path
):
    path = tiny_model_paths["llama"]
    torch.manual_seed(0)
    worker = PolicyWorker(
        make_config(path, dtensor_cfg={"lora_cfg": LORA}), init_reference_model=False
    )
    engine = _engine(path, worker, tmp_path / "adapter")
    info = worker.prepare_refit_info(adapter_only=True)
    assert all(n.startswith("base_model.model.") and ".lora_" in n for n in info)
    receiver = HFWeightReceiver(
        peft_load_weights(engine, info), address=worker.get_zmq_address(), refit_info=info
    )
    probe = make_batch(4, 10, seed=7)
    full_bytes = sum(
        shape.numel() * dtype.itemsize for shape, dtype in worker.prepare_refit_info().values()
    )
    try:
        for version in (1, 2):
            worker.train(make_batch(4, 10, seed=version), NLLLoss())
            before = _logprobs(engine, probe)
            report, received = _refit(worker, receiver)
            assert report["version"] == received.version == version
            assert received.num_tensors == len(info)
            assert received.num_bytes == sum(s.numel() * 4 for s, _ in info.values())
            assert received.num_bytes < full_bytes / 4
            after = _logprobs(engine, probe)
            assert not torch.allclose(before, after)
            torch.testing.assert_close(
                after, worker.get_logprobs(probe)["logprobs"], rtol=1e-5, atol=1e-5
            )
    finally:
        receiver.close()


def test_a_peft_model_without_one_of_the_modules_is_refused_by_name(tiny_model_paths, tmp_path):
    path = tiny_model_paths["llama"]
    worker = PolicyWorker(
        make_config(path, dtensor_cfg={"lora_cfg": LORA}), init_reference_model=False
    )
    fewer = PolicyWorker(
        make_config(path, dtensor_cfg={"lora_cfg": {**LORA, "target_modules": ["q_proj"]}}),
        init_reference_model=False,
    )
    engine = _engine(path, fewer, tmp_path / "fewer")
    with pytest.raises(ValueError, match=r"cannot receive \d+ adapter tensor\(s\).*v_proj"):
        peft_load_weights(engine, worker.prepare_refit_info(adapter_only=True))


def test_adapter_only_needs_a_lora_worker(tiny_model_paths):
    worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    with pytest.raises(ValueError, match="needs a LoRA worker"):
        worker.stream_weights_via_ipc_zmq(adapter_only=True)
    with pytest.raises(ValueError, match="needs a LoRA model"):
        worker.prepare_refit_info(adapter_only=True)


def test_an_adapter_refit_cut_off_midway_leaves_an_atomic_engine_on_its_version(
    tiny_model_paths, tmp_path
):
    from policyworker.shell.refit.adapter_refit import adapter_stream

    path = tiny_model_paths["llama"]
    torch.manual_seed(0)
    worker = PolicyWorker(
        make_config(path, dtensor_cfg={"lora_cfg": LORA}), init_reference_model=False
    )
    engine = _engine(path, worker, tmp_path / "adapter")
    info = worker.prepare_refit_info(adapter_only=True)
    receiver = HFWeightReceiver(
        peft_load_weights(engine, info), address=None, refit_info=info, atomic=True
    )
    worker.train(make_batch(4, 10, seed=1), NLLLoss())
    probe = make_batch(4, 10, seed=7)
    before = _logprobs(engine, probe)
    stream = adapter_stream(worker.model, dtype=torch.float32)
    pairs = [(s.name, s.tensor) for s in stream.sources]
    receiver.begin_refit(info)
    receiver.apply_batch(pairs[: len(pairs) // 2])
    receiver.abort_refit("the trainer died")  # the rest never arrives
    assert receiver.version == 0 and not receiver.stale
    assert torch.equal(_logprobs(engine, probe), before)
    report = receiver.apply_named_tensors(pairs, manifest=info)  # the next refit lands whole
    assert report.version == 1
    torch.testing.assert_close(
        _logprobs(engine, probe), worker.get_logprobs(probe)["logprobs"], rtol=1e-5, atol=1e-5
    )


def test_the_adapter_refit_is_sent_in_the_full_refits_dtype(tiny_model_paths):
    """A bf16 worker sends bf16 adapters (what a bf16 engine serves), a float32 worker fp32."""
    path = tiny_model_paths["llama"]
    for precision, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        cfg = make_config(path, precision=precision, dtensor_cfg={"lora_cfg": LORA})
        worker = PolicyWorker(cfg, init_reference_model=False)
        full = {d for _, d in worker.prepare_refit_info().values() if d.is_floating_point}
        adapter = worker.prepare_refit_info(adapter_only=True)
        assert full == {dtype} and {d for _, d in adapter.values()} == {dtype}, precision

"""Several named LoRA adapters on one base (`lora_cfg.adapters`) and the base as the reference.

Training adapters in turn on one worker equals single-adapter workers bit for bit
(fp32 on the CPU: the same ops in the same order on the same values).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from policyworker.errors import ConfigError
from policyworker.functional.loss import NLLLoss
from policyworker.shell.model.lora import lora_state_dict
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import hf_reference_logprobs, make_batch, make_config

LORA = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 4, "alpha": 8}
# a scheduler whose LR moves every step: each adapter must keep its own clock
SCHEDULER = {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.5}}


def _worker(path: str, **lora: object) -> PolicyWorker:
    torch.manual_seed(0)  # the adapters' initial lora_A values
    cfg = make_config(path, dtensor_cfg={"lora_cfg": {**LORA, **lora}}, scheduler=SCHEDULER)
    return PolicyWorker(cfg, init_reference_model=False)


def test_adapters_trained_in_turn_equal_single_adapter_workers(tiny_model_paths):
    path = tiny_model_paths["llama"]
    names = ("math", "code", "chat")
    both = _worker(path, adapters=list(names))
    alone = {name: _worker(path) for name in names}
    for step in range(3):
        for i, name in enumerate(names[: 2 + step % 2]):  # "chat" trains less often
            data = make_batch(4, 10, seed=10 * step + i)
            got = both.train(data, NLLLoss(), adapter=name)
            want = alone[name].train(data, NLLLoss())
            assert torch.equal(got["global_loss"], want["global_loss"]), (step, name)
    probe = make_batch(4, 10, seed=99)
    for name, single in alone.items():
        got = both.get_logprobs(probe, adapter=name)["logprobs"]
        assert torch.equal(got, single.get_logprobs(probe)["logprobs"]), name
        both.select_adapter(name)
        mine, theirs = lora_state_dict(both.model), lora_state_dict(single.model)
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), name
        assert both.optimizer.param_groups[0]["lr"] == single.optimizer.param_groups[0]["lr"]
    trained = {k: v.clone() for k, v in lora_state_dict(both.model).items()}  # CPU: views
    both.select_adapter("math")
    assert any(not torch.equal(trained[k], v) for k, v in lora_state_dict(both.model).items())


def test_each_adapter_saves_a_peft_folder_that_reproduces_its_logprobs(tiny_model_paths, tmp_path):
    from peft import PeftModel

    path = tiny_model_paths["llama"]
    worker = _worker(path, adapters=["a", "b"])
    worker.train(make_batch(4, 10, seed=1), NLLLoss(), adapter="a")
    worker.train(make_batch(4, 10, seed=2), NLLLoss(), adapter="b")
    probe = make_batch(4, 10, seed=3)
    for name in ("a", "b"):
        worker.select_adapter(name)
        worker.save_checkpoint(str(tmp_path / name), is_final_checkpoint=True)
    for name in ("a", "b"):
        base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / name / "model")).eval()
        with torch.no_grad():
            logits = peft_model(input_ids=probe["input_ids"]).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, probe["input_ids"][:, 1:, None])
        lp = torch.cat([torch.zeros_like(lp[:, :1, 0]), lp[..., 0]], dim=1)
        valid = torch.arange(10)[None] < probe["input_lengths"][:, None]
        want = torch.where(valid, lp, torch.zeros_like(lp))
        got = worker.get_logprobs(probe, adapter=name)["logprobs"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_base_reference_is_the_model_without_adapters_and_copies_nothing(tiny_model_paths):
    path = tiny_model_paths["llama"]
    torch.manual_seed(0)
    cfg = make_config(path, dtensor_cfg={"lora_cfg": {**LORA, "reference": "base"}})
    worker = PolicyWorker(cfg)  # init_reference_model=True: no copy is made all the same
    assert worker._reference_state is None
    worker.train(make_batch(4, 10, seed=1), NLLLoss())
    probe = make_batch(4, 10, seed=5)
    ref = worker.get_reference_policy_logprobs(probe)["reference_logprobs"]
    torch.testing.assert_close(ref, hf_reference_logprobs(path, probe), rtol=1e-5, atol=1e-5)
    policy = worker.get_logprobs(probe)["logprobs"]
    assert not torch.allclose(policy, ref)  # the adapter is back on after the context


def test_an_unknown_adapter_is_refused_before_any_step(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"], adapters=["a", "b"])
    before = {k: v.clone() for k, v in lora_state_dict(worker.model).items()}
    with pytest.raises(ValueError, match=r"adapter='c' is not an adapter of this worker"):
        worker.train(make_batch(4, 10), NLLLoss(), adapter="c")
    after = lora_state_dict(worker.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("names", [["a", "a"], ["a", "b c"], [""]])
def test_lora_cfg_adapters_must_be_distinct_plain_names(tiny_model_paths, names):
    cfg = make_config(tiny_model_paths["llama"], dtensor_cfg={"lora_cfg": {"adapters": names}})
    with pytest.raises(ConfigError, match="adapters"):
        PolicyWorker(cfg)


def test_an_adapter_comes_back_on_the_device_of_the_optimizer_state_it_replaces(
    tiny_model_paths,
):
    """An offload moves only the state the optimizer holds: a parked adapter's state is moved
    where the live state is when it comes back (here the "meta" device stands in for another)."""
    worker = _worker(tiny_model_paths["llama"], adapters=["a", "b"])
    worker.train(make_batch(4, 10, seed=1), NLLLoss(), adapter="a")
    worker.train(make_batch(4, 10, seed=2), NLLLoss(), adapter="b")
    for opt_state in worker.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            opt_state[key] = opt_state[key].to("meta")  # b's state, "offloaded"
    worker.select_adapter("a")
    devices = {
        s[key].device.type
        for s in worker.optimizer.state.values()
        for key in ("exp_avg", "exp_avg_sq")
    }
    assert devices == {"meta"}

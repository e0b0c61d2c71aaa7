"""`dtensor_cfg.fp8` on one CUDA device: torchao float8 linears under the layer compile, full
fine-tuning and LoRA, against the same worker without fp8. On a GPU below compute capability
8.9 the same tests check the fallback instead (one warning, the bf16 path)."""

import warnings

import pytest
import torch

from policyworker.functional.float8_training import MIN_CAPABILITY
from policyworker.functional.loss import NLLLoss
from policyworker.shell.model import float8 as float8_lib
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.helpers import save_float8_tiny_qwen2
from tests.shell.conftest import make_batch, make_config

pytestmark = pytest.mark.gpu

LORA = {"lora_cfg": {"match_all_linear": True, "dim": 4, "alpha": 8}}
SGD = {"name": "torch.optim.SGD", "kwargs": {"lr": 1e-2}}
# torchao's float8 path on the CPU moved this model's NLL by up to 0.0011 (of ~4.9) against
# bf16; the layer compile's bf16 rounding adds about as much: 0.02 leaves ten times that.
LOSS_ATOL = 0.02


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_float8_tiny_qwen2(tmp_path_factory.mktemp("fp8") / "qwen2")


def _fp8_capable() -> bool:
    return torch.cuda.get_device_capability() >= MIN_CAPABILITY


def _workers(path: str, dtensor_cfg: dict) -> tuple[PolicyWorker, PolicyWorker]:
    """(without fp8, with fp8), both bf16 with the default fusion (the layer compile)."""
    float8_lib.reset_warnings()
    built = []
    for fp8 in (None, {"recipe": "tensorwise"}):
        cfg = make_config(path, precision="bfloat16", optimizer=SGD)
        cfg["dtensor_cfg"] = {**dtensor_cfg, "fp8": fp8}
        built.append(PolicyWorker(cfg, init_reference_model=False))
    return built[0], built[1]


def _layout(worker: PolicyWorker) -> dict:
    return {k: (v.dtype, v.shape) for k, v in worker.model.state_dict().items()}


def _check_fp8_ran_or_fell_back(worker: PolicyWorker, *, lora: bool) -> None:
    report = worker.float8_report
    if not _fp8_capable():
        assert report.fallback_reason is not None and "compute capability" in report.fallback_reason
        return
    assert report.fallback_reason is None, report
    assert (
        len(report.lora if lora else report.converted) == 2 * 7
    )  # 2 layers x q k v o gate up down
    assert worker.fusion_report.fused_layers > 0, worker.fusion_report  # the compile probe passed


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp8_worker_trains_close_to_bf16_with_the_same_names_and_dtypes(model_path, lora):
    plain, fp8 = _workers(model_path, LORA if lora else {})
    _check_fp8_ran_or_fell_back(fp8, lora=lora)
    assert _layout(fp8) == _layout(plain)
    params = [(n, p.dtype, p.requires_grad) for n, p in fp8.model.named_parameters()]
    assert params == [(n, p.dtype, p.requires_grad) for n, p in plain.model.named_parameters()]
    assert {p.dtype for p in fp8.model.parameters()} == {torch.float32}  # fp32 master weights
    # the loss of this near-uniform model hardly moves, so the logprobs' pattern is the check
    # of the float8 GEMMs (0.9999 on the CPU; a broken GEMM decorrelates them)
    data = make_batch(8, 32, seed=20)
    positions = torch.arange(32)
    scored = (positions[None] < data["input_lengths"][:, None]) & (positions[None] >= 1)
    logprobs = [w.get_logprobs(data)["logprobs"][scored] for w in (fp8, plain)]
    assert float(torch.corrcoef(torch.stack(logprobs))[0, 1]) > 0.99
    for seed in range(3):
        data = make_batch(8, 32, seed=seed)
        got, want = (float(w.train(data, NLLLoss())["global_loss"][0]) for w in (fp8, plain))
        assert abs(got - want) < LOSS_ATOL, (seed, got, want)
    if lora:  # B starts at zero: the adapters trained through the float8 base's input gradient
        layer = fp8.model.get_submodule(fp8.lora_module_names[0])
        assert layer.lora_B.weight.abs().sum() > 0
    logprobs = fp8.get_logprobs(make_batch(8, 32, seed=10))["logprobs"]
    assert torch.isfinite(logprobs).all()


def test_fp8_refit_sends_the_same_names_dtypes_and_weights(model_path):
    """Before any step both workers hold the checkpoint: the refit stream is identical, name for
    name and bit for bit (float8 only changes how the GEMMs compute)."""
    plain, fp8 = _workers(model_path, {"fusion": "none"})  # no compile needed
    assert fp8.float8_report.active == _fp8_capable()
    assert fp8.prepare_refit_info() == plain.prepare_refit_info()
    from policyworker.shell.refit.weight_stream import params_generator

    got = list(params_generator(fp8.model, torch.bfloat16))
    want = list(params_generator(plain.model, torch.bfloat16))
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))


def test_fp8_on_cuda_warns_only_when_it_falls_back(model_path):
    float8_lib.reset_warnings()
    cfg = make_config(model_path, precision="bfloat16")
    cfg["dtensor_cfg"] = {"fp8": {}, "fusion": "none"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = PolicyWorker(cfg, init_reference_model=False)
    fp8_warnings = [w for w in caught if "dtensor_cfg.fp8" in str(w.message)]
    assert len(fp8_warnings) == (0 if _fp8_capable() else 1)
    assert worker.float8_report.active == _fp8_capable()

"""Elementwise fusion (torch.compile, inductor on CPU) keeps logits and gradients of tiny
Llama / Qwen2 / Qwen3 models, counts what it fused, and falls back cleanly when compiling fails.

Compiling dominates the run time, so each (model, mode) pair is fused once per module and the
inputs keep batch >= 2, which reuses the graphs the fuse-time probe compiled.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from policyworker.shell.kernels import compile_cache, fusion
from policyworker.shell.kernels.fusion import fuse_elementwise, unfuse_elementwise
from policyworker.shell.model.lora import apply_lora, lora_modules
from tests.helpers import TINY_DECODER_SHAPE

KINDS = ("llama", "qwen2", "qwen3")
MODES = ("norm_mlp", "layer")
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _tiny_model(kind: str) -> torch.nn.Module:
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[kind]
    extra = {"head_dim": 8} if kind == "qwen3" else {}
    torch.manual_seed(KINDS.index(kind))
    model = transformers.AutoModelForCausalLM.from_config(
        cls(**TINY_DECODER_SHAPE, use_cache=False, **extra), attn_implementation="sdpa"
    )
    with torch.no_grad():  # norm weights off 1, so the weight multiply is checked too
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
    return model


def _token_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, TINY_DECODER_SHAPE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(seed)
    )


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Called as the worker calls a padded microbatch, whose graphs the fuse probe compiled."""
    position_ids = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    return model(input_ids=ids, position_ids=position_ids, use_cache=False).logits


def _logits_and_grads(model: torch.nn.Module, ids: torch.Tensor, *, seed: int = 0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = _logits(model, ids)
    logits.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _assert_same_grads(got: dict, expected: dict) -> None:
    """Equal up to 1e-5 of each gradient's largest entry: fused kernels sum in another order,
    and a sum-of-logits backward accumulates entries up to ~100 in the embedding gradient."""
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(
            got[name],
            grad,
            rtol=1e-5,
            atol=1e-5 * max(scale, 1.0),
            msg=lambda m, name=name: f"{name}: {m}",
        )


def _instance_forwards(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


@pytest.fixture(
    scope="module", params=[(k, m) for k in KINDS for m in MODES], ids=lambda p: f"{p[0]}-{p[1]}"
)
def fused(request):
    """(model, report, eager logits, eager grads, kind) for one (model kind, mode) pair."""
    kind, mode = request.param
    model = _tiny_model(kind)
    reference = _logits_and_grads(model, _token_ids())
    report = fuse_elementwise(model, mode=mode)
    return model, report, *reference, kind


def test_report_counts_every_norm_mlp_or_layer(fused):
    model, report, *_ = fused
    names = [type(m).__name__ for m in model.modules()]
    assert report.fallback_reason is None
    if report.mode == "norm_mlp":
        expected = (
            sum(n.endswith("RMSNorm") for n in names),
            sum(n.endswith("MLP") for n in names),
            0,
        )
    else:
        expected = (0, 0, len(model.model.layers))
    assert (report.fused_norms, report.fused_mlps, report.fused_layers) == expected
    assert len(_instance_forwards(model)) == sum(expected) > 0


def test_fused_model_gives_eager_logits_and_parameter_grads(fused):
    model, _, logits, grads, _ = fused
    got_logits, got_grads = _logits_and_grads(model, _token_ids())
    torch.testing.assert_close(got_logits, logits, **TOL)
    _assert_same_grads(got_grads, grads)


def test_fusing_twice_wraps_once_and_reports_the_same(fused):
    model, report, *_ = fused
    forwards = {
        n: m.__dict__["forward"].__func__
        for n, m in model.named_modules()
        if "forward" in m.__dict__
    }
    assert fuse_elementwise(model, mode=report.mode) == report
    assert {
        n: m.__dict__["forward"].__func__
        for n, m in model.named_modules()
        if "forward" in m.__dict__
    } == forwards


def test_unfuse_restores_bit_identical_eager_behaviour(fused):
    model, report, *_, kind = fused
    fresh = _tiny_model(kind)
    assert unfuse_elementwise(model) == report.fused_norms + report.fused_mlps + report.fused_layers
    assert _instance_forwards(model) == []
    ids = _token_ids(seed=1)
    with torch.no_grad():
        assert torch.equal(_logits(model, ids), _logits(fresh, ids))


def test_mode_none_changes_nothing():
    model = _tiny_model("llama")
    report = fuse_elementwise(model, mode="none")
    assert (report.fused_norms, report.fused_mlps, report.fused_layers) == (0, 0, 0)
    assert report.fallback_reason is None and _instance_forwards(model) == []


def test_unknown_mode_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"mode='fast' .*'auto', 'none', 'norm_mlp', 'layer'"):
        fuse_elementwise(_tiny_model("llama"), mode="fast")


@pytest.mark.parametrize("mode", MODES)
def test_compile_failure_falls_back_to_original_forwards_with_a_warning(monkeypatch, mode):
    def broken_compile(fn, **kwargs):
        def raise_at_first_call(*args, **kw):
            msg = "inductor exploded"
            raise RuntimeError(msg)

        return raise_at_first_call

    monkeypatch.setattr(compile_cache, "_COMPILED", {})  # the real compiled functions stay cached
    monkeypatch.setattr(fusion.torch, "compile", broken_compile)
    model = _tiny_model("qwen3")
    expected = _logits(model, _token_ids())
    with pytest.warns(RuntimeWarning, match="fell back to the unfused model: RuntimeError: ind"):
        report = fuse_elementwise(model, mode=mode)
    assert report.fallback_reason == "RuntimeError: inductor exploded"
    assert (report.fused_norms, report.fused_mlps, report.fused_layers) == (0, 0, 0)
    assert _instance_forwards(model) == []
    assert torch.equal(_logits(model, _token_ids()), expected)


def test_norm_with_other_semantics_is_left_alone():
    """A Gemma-style RMSNorm (`1 + weight`, cast after the multiply) matches by name only."""
    model = _tiny_model("llama")
    model.model.norm = Gemma3RMSNorm(TINY_DECODER_SHAPE["hidden_size"], eps=1e-6)
    report = fuse_elementwise(model, mode="norm_mlp")
    assert report.fallback_reason is None and report.fused_norms == 2 * 2
    assert "forward" not in model.model.norm.__dict__


def test_lora_wrapped_projections_keep_their_adapters_and_dropout():
    model = _tiny_model("llama")
    apply_lora(model, {"match_all_linear": True, "dim": 4, "dropout": 0.1})
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_(0.0, 0.02)  # a non-zero adapter path
    model.train()
    logits, grads = _logits_and_grads(model, _token_ids(), seed=3)
    report = fuse_elementwise(model, mode="norm_mlp")
    assert report.fallback_reason is None and report.fused_mlps == 2
    got_logits, got_grads = _logits_and_grads(model, _token_ids(), seed=3)
    torch.testing.assert_close(got_logits, logits, **TOL)
    assert all(".lora_" in n for n in grads)
    _assert_same_grads(got_grads, grads)


# ---------------------------------------------------------------------------- through the worker


def test_worker_fusion_config_keeps_logprobs_and_training(tiny_model_paths):
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_batch, make_config

    data = make_batch(seed=3)
    sgd = {
        "name": "torch.optim.SGD",
        "kwargs": {"lr": 1e-2},
    }  # Adam would blow up ~0-gradient noise
    eager = PolicyWorker(make_config(tiny_model_paths["qwen2"], optimizer=sgd))
    fused = PolicyWorker(
        make_config(tiny_model_paths["qwen2"], optimizer=sgd, dtensor_cfg={"fusion": "norm_mlp"})
    )
    assert eager.fusion_report.mode == "none"
    assert fused.fusion_report.fused_norms == 5 and fused.fusion_report.fallback_reason is None
    assert fused.fusion_report.logprobs == "fused", fused.fusion_report  # shell.fused_logprobs
    assert fused.fusion_report.summary() == "norm_mlp; logprobs fused"
    torch.testing.assert_close(
        fused.get_logprobs(data)["logprobs"], eager.get_logprobs(data)["logprobs"], **TOL
    )
    want, got = eager.train(data, NLLLoss()), fused.train(data, NLLLoss())
    torch.testing.assert_close(got["global_loss"], want["global_loss"], **TOL)
    for (name, a), (_, b) in zip(
        eager.model.named_parameters(), fused.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b, a, **TOL, msg=name)


def test_worker_fusion_with_a_process_group_is_refused_before_loading(
    tiny_model_paths, monkeypatch
):
    import types

    from policyworker.shell.model import hf_model as model_lib
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_config

    def never(*_a, **_k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(model_lib, "load_policy_model", never)
    two_ranks = types.SimpleNamespace(tp_size=1, cp_size=1, dp_size=2, world_size=2, mesh=object())
    with pytest.raises(ValueError, match=r"dtensor_cfg.fusion='layer'.*world size 2.*fusion: none"):
        PolicyWorker(
            make_config(tiny_model_paths["llama"], dtensor_cfg={"fusion": "layer"}),
            parallel=two_ranks,
        )


def test_unknown_fusion_mode_in_config_names_the_key():
    from policyworker.config import load_config
    from policyworker.errors import ConfigError

    with pytest.raises(ConfigError, match=r"policy\.dtensor_cfg\.fusion"):
        load_config({"model_name": "x", "dtensor_cfg": {"fusion": "fast"}})


# ---------------------------------------------------------------------------- auto (the default)


@pytest.mark.parametrize(
    ("mode", "device", "distributed", "expected"),
    [
        ("auto", "cpu", False, "none"),
        ("auto", "cuda", False, "layer"),
        ("auto", "cuda", True, "none"),
        ("norm_mlp", "cpu", False, "norm_mlp"),
        ("none", "cuda", False, "none"),
    ],
)
def test_auto_is_layer_on_cuda_in_one_process_and_none_elsewhere(
    mode, device, distributed, expected
):
    got = fusion.resolve_fusion_mode(mode, device=torch.device(device), distributed=distributed)
    assert got == expected


def test_auto_on_cpu_runs_eager_and_reports_the_resolution():
    model = _tiny_model("llama")
    report = fuse_elementwise(model, mode="auto")
    assert (report.mode, report.requested, report.effective_mode) == ("none", "auto", "none")
    assert report.summary() == "none (auto)" and _instance_forwards(model) == []


def test_auto_fallback_logs_once_and_runs_eager(monkeypatch, caplog, tmp_path):
    def broken_compile(fn, **kwargs):
        def raise_at_first_call(*args, **kw):
            msg = "no inductor today"
            raise RuntimeError(msg)

        return raise_at_first_call

    monkeypatch.setattr(compile_cache, "_COMPILED", {})
    monkeypatch.setattr(fusion, "_LOGGED_FALLBACKS", set())
    monkeypatch.setattr(fusion, "_AUTO_MODES", {"cpu": "layer"})  # CPU stands in for CUDA
    monkeypatch.setattr(fusion.torch, "compile", broken_compile)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = _tiny_model("qwen2")
    expected = _logits(model, _token_ids())
    with caplog.at_level("WARNING", logger="policyworker"), pytest.warns(RuntimeWarning):
        first = fuse_elementwise(model, mode="auto")
        second = fuse_elementwise(model, mode="auto")
    assert first == second
    assert (first.mode, first.requested, first.effective_mode) == ("layer", "auto", "none")
    assert first.summary() == "none (layer fell back: RuntimeError: no inductor today)"
    records = [r for r in caplog.records if "fell back" in r.getMessage()]
    assert len(records) == 1 and "RuntimeError: no inductor today" in records[0].getMessage()
    assert _instance_forwards(model) == []
    assert torch.equal(_logits(model, _token_ids()), expected)


def test_persistent_compile_cache_is_set_only_when_the_user_has_not(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = compile_cache.use_persistent_compile_cache()
    assert folder == str(tmp_path / "policyworker" / "torchinductor")
    assert (tmp_path / "policyworker" / "torchinductor").is_dir()
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.use_persistent_compile_cache() == str(tmp_path / "mine")


def test_worker_default_fusion_is_auto_and_the_log_line_says_what_ran(tiny_model_paths, caplog):
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_config

    with caplog.at_level("INFO", logger="policyworker"):
        worker = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    report = worker.fusion_report
    assert (report.requested, report.mode, report.fallback_reason) == ("auto", "none", None)
    assert any("fusion=none (auto)" in r.getMessage() for r in caplog.records)


def test_worker_auto_fusion_with_a_process_group_is_not_refused(tiny_model_paths, monkeypatch):
    import types

    from policyworker.shell.model import hf_model as model_lib
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_config

    def loaded(*_a, **_k):
        raise LookupError("validation passed; the model would load now")

    monkeypatch.setattr(model_lib, "load_policy_model", loaded)
    two_ranks = types.SimpleNamespace(
        tp_size=1,
        cp_size=1,
        dp_size=2,
        world_size=2,
        rank=0,
        mesh=object(),
        device=torch.device("cpu"),
    )
    with pytest.raises(LookupError, match="validation passed"):
        PolicyWorker(make_config(tiny_model_paths["llama"]), parallel=two_ranks)

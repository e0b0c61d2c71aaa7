"""`dtensor_cfg.fp8` on the CPU: config validation, the one-warning fallback, and the
conversion itself with torchao's real float8 path (torch has a CPU kernel for
`torch._scaled_mm`; the worker never converts on the CPU, `check_device=False` does here)."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from policyworker.config import Float8Config, load_config
from policyworker.errors import ConfigError
from policyworker.functional.loss import NLLLoss
from policyworker.shell.model import float8 as float8_lib
from policyworker.shell.model.hf_model import check_document_isolation
from policyworker.shell.model.lora import LinearLoRA, apply_lora
from policyworker.shell.refit.weight_stream import params_generator
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config


@pytest.fixture
def torchao():
    """The conversion tests need the fp8 extra (in the test extra); the fallback tests do not."""
    return pytest.importorskip("torchao")


@pytest.fixture(autouse=True)
def _fresh_warnings():
    float8_lib.reset_warnings()
    yield
    float8_lib.reset_warnings()


def _model(path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _layout(model):
    return {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- config


def test_fp8_section_structures_with_the_tensorwise_default():
    cfg = load_config({"model_name": "m", "dtensor_cfg": {"fp8": {}}})
    assert cfg.dtensor_cfg.fp8 == Float8Config(recipe="tensorwise")
    assert load_config({"model_name": "m"}).dtensor_cfg.fp8 is None
    off = load_config({"model_name": "m", "dtensor_cfg": {"fp8": {"enabled": False}}})
    assert off.dtensor_cfg.fp8 is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"recipe": "delayed"}, r"'delayed' is not one of 'tensorwise'.*@ policy.dtensor_cfg.fp8"),
        ({"recpie": "rowwise"}, r"did you mean 'recipe'.*@ policy.dtensor_cfg.fp8"),
        (True, r"expected a mapping or null.*@ policy.dtensor_cfg.fp8"),
    ],
)
def test_bad_fp8_sections_name_the_path(value, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"model_name": "m", "dtensor_cfg": {"fp8": value}})


# ---------------------------------------------------------------------------- fallback


def test_cpu_fallback_warns_exactly_once_and_leaves_the_model_as_it_was(tiny_model_paths):
    models = [_model(tiny_model_paths["qwen2"]) for _ in range(2)]
    before = [_layout(m) for m in models]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = [
            float8_lib.apply_float8_training(m, Float8Config(), device=torch.device("cpu"))
            for m in models
        ]
    fp8_warnings = [w for w in caught if "dtensor_cfg.fp8" in str(w.message)]
    assert len(fp8_warnings) == 1
    assert "need a CUDA device (the worker's device is cpu)" in str(fp8_warnings[0].message)
    assert all(r.fallback_reason and not r.active for r in reports)
    assert [_layout(m) for m in models] == before
    assert not any(type(m).__name__ == "Float8Linear" for m in models[0].modules())


def test_a_worker_asking_for_fp8_on_cpu_trains_exactly_as_without(tiny_model_paths):
    """The fallback is the bf16/fp32 path itself: the same losses bit for bit."""
    path = tiny_model_paths["qwen2"]
    losses = {}
    for fp8 in (None, {"recipe": "tensorwise"}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            worker = PolicyWorker(
                make_config(path, dtensor_cfg={"fp8": fp8}), init_reference_model=False
            )
        assert worker.float8_report.requested == (fp8 is not None)
        assert len([w for w in caught if "dtensor_cfg.fp8" in str(w.message)]) == (
            0 if fp8 is None else 1
        )
        losses[fp8 is None] = [
            worker.train(make_batch(seed=s), NLLLoss())["global_loss"] for s in range(2)
        ]
    for a, b in zip(losses[True], losses[False], strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- conversion


def test_conversion_swaps_only_decoder_linears_and_keeps_names(tiny_model_paths, torchao):
    model = _model(tiny_model_paths["qwen2"])
    before = _layout(model)
    params_before = {n: p for n, p in model.named_parameters()}
    report = float8_lib.apply_float8_training(
        model, Float8Config(), device=torch.device("cpu"), check_device=False
    )
    assert _layout(model) == before
    # the same Parameter objects: the optimizer built afterwards sees the master weights
    assert {n: p for n, p in model.named_parameters()} == params_before
    swapped = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert swapped == set(report.converted) and len(swapped) == 2 * 7  # q k v o gate up down
    assert all(".layers." in n for n in swapped)
    assert type(model.lm_head) is torch.nn.Linear
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    assert report.num_skipped == 1  # lm_head


def test_fp8_training_is_close_to_high_precision(tiny_model_paths, torchao):
    """Forward and backward through the converted model stay within fp8 rounding of fp32."""
    ref, fp8 = _model(tiny_model_paths["qwen2"]), _model(tiny_model_paths["qwen2"])
    float8_lib.apply_float8_training(
        fp8, Float8Config(), device=torch.device("cpu"), check_device=False
    )
    ids = make_batch(2, 12, seed=3)["input_ids"]
    outs = []
    for model in (ref, fp8):
        logits = model(input_ids=ids).logits
        logits.logsumexp(-1).mean().backward()
        outs.append((logits, model.model.layers[0].mlp.down_proj.weight.grad))
    (ref_logits, ref_grad), (fp8_logits, fp8_grad) = outs
    assert not torch.equal(ref_logits, fp8_logits)  # the casts did happen
    # e4m3 keeps 3 mantissa bits: one converted linear errs by ~4% of its output's norm (the
    # LoRA test below); fourteen of them in this random model (matrices from N(0, 0.2), which
    # amplify perturbations) reach ~15% at the logits. A broken cast misses by the norm itself.
    rel = float((fp8_logits - ref_logits).norm() / ref_logits.norm())
    assert rel < 0.3, rel
    cos = torch.nn.functional.cosine_similarity(fp8_grad.flatten(), ref_grad.flatten(), dim=0)
    assert float(cos) > 0.95


def test_lora_layers_get_a_frozen_float8_base_and_keep_their_adapters(tiny_model_paths, torchao):
    model = _model(tiny_model_paths["qwen2"])
    names = apply_lora(model, {"match_all_linear": True, "dim": 4, "alpha": 8})
    before = _layout(model)
    report = float8_lib.apply_float8_training(
        model, Float8Config(), device=torch.device("cpu"), check_device=False
    )
    assert set(report.lora) == set(names) and report.converted == ()
    assert _layout(model) == before
    layer = model.get_submodule(names[0])
    assert isinstance(layer, LinearLoRA) and layer.fp8_linear is not None
    assert layer.merged_weights(torch.bfloat16) is None  # the float8 base is not merged
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 5, layer.in_features, requires_grad=True)
    out = layer(x)
    layer.fp8_linear = None
    want = layer(x)
    assert float((out - want).norm() / want.norm()) < 0.08  # e4m3: ~4% for one linear
    out.sum().backward()
    assert layer.weight.grad is None  # the frozen base takes no gradient
    assert layer.lora_A.weight.grad is not None and x.grad is not None
    assert torch.isfinite(x.grad).all()


def test_refit_names_and_dtypes_are_unchanged_by_the_conversion(tiny_model_paths, torchao):
    model = _model(tiny_model_paths["qwen2"])
    want = [(n, t.dtype, t.shape) for n, t in params_generator(model, torch.bfloat16)]
    float8_lib.apply_float8_training(
        model, Float8Config(), device=torch.device("cpu"), check_device=False
    )
    got = [(n, t.dtype, t.shape) for n, t in params_generator(model, torch.bfloat16)]
    assert got == want


def _cuda_scaled_mm_rules(real):
    """torch._scaled_mm with CUDA's shape rules, which the CPU kernel does not check."""

    def scaled_mm(mat1, mat2, *args, **kwargs):
        assert mat1.shape[1] % 16 == 0, f"mat1 {tuple(mat1.shape)}: trailing dim % 16 != 0"
        assert mat2.shape[0] % 16 == 0 and mat2.shape[1] % 16 == 0, f"mat2 {tuple(mat2.shape)}"
        return real(mat1, mat2, *args, **kwargs)

    return scaled_mm


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_token_counts_not_divisible_by_16_meet_cudas_gemm_rules(
    tiny_model_paths, torchao, monkeypatch, lora
):
    """A [2, 3] microbatch (6 tokens, as the compile probe's) trains through every float8 GEMM
    under CUDA's rule: the weight gradient's inner dim is the token count, so it is padded."""
    model = _model(tiny_model_paths["qwen2"])
    if lora:
        apply_lora(model, {"match_all_linear": True, "dim": 4, "alpha": 8})
    report = float8_lib.apply_float8_training(
        model, Float8Config(), device=torch.device("cpu"), check_device=False
    )
    assert report.active
    monkeypatch.setattr(torch, "_scaled_mm", _cuda_scaled_mm_rules(torch._scaled_mm))
    logits = model(input_ids=make_batch(2, 3, seed=0)["input_ids"]).logits
    logits.logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_recipe_trains_through_both_kinds_of_layer(tiny_model_paths, torchao, recipe, lora):
    model = _model(tiny_model_paths["qwen2"])
    if lora:
        apply_lora(model, {"match_all_linear": True, "dim": 4, "alpha": 8})
    report = float8_lib.apply_float8_training(
        model, Float8Config(recipe=recipe), device=torch.device("cpu"), check_device=False
    )
    assert report.active and report.recipe == recipe
    logits = model(input_ids=make_batch(2, 8, seed=1)["input_ids"]).logits
    logits.logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_packing_probe_tests_attention_with_the_float8_matmuls_paused(
    tiny_model_paths, torchao, monkeypatch, lora
):
    """A per-tensor float8 scale is one amax over the whole packed row: the probe, which
    perturbs the row's first document, would see the second's rounding move. It runs with the
    matmuls in high precision; float8 serves again after it."""
    monkeypatch.setattr(float8_lib, "float8_support", lambda *a, **k: None)  # convert on CPU
    cfg = make_config(
        tiny_model_paths["qwen2"],
        sequence_packing={"enabled": True, "train_mb_tokens": 32},
        dtensor_cfg={
            "fp8": {"recipe": "tensorwise"},
            **({"lora_cfg": {"enabled": True, "match_all_linear": True, "dim": 4}} if lora else {}),
        },
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    report = worker.float8_report
    assert report.active and (bool(report.lora) if lora else bool(report.converted))
    model = worker.model
    for name in report.converted:
        assert "forward" not in vars(model.get_submodule(name))
    for name in report.lora:
        assert model.get_submodule(name).fp8_linear is not None
    with pytest.raises(ValueError, match="lets packed documents attend"):
        check_document_isolation(model, autocast_dtype=torch.float32)  # float8 scales couple
    with float8_lib.float8_matmuls_paused(model, report):
        check_document_isolation(model, autocast_dtype=torch.float32)
    assert worker.train(make_batch(seed=1), NLLLoss())["global_loss"].isfinite()

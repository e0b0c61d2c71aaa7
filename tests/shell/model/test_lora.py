import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from policyworker.errors import LoRAMergeError
from policyworker.functional.lora import assert_lora_modules_reachable, merge_lora_weight
from policyworker.shell.model.lora import (
    LinearLoRA,
    _MergedAdapterLinear,
    apply_lora,
    lora_modules,
    lora_parameters,
    resolve_compute_dtype,
)
from policyworker.shell.model.lora_tp import lora_tp_plan
from policyworker.shell.model.peft_adapter import load_peft_adapter, save_peft_adapter
from tests.distributed.launch import run_on_gloo

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_config(arch):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(**TINY, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tokens(seed=0, batch=2, seq=9):
    return torch.randint(
        0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _randomize_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(0.1 * torch.randn(m.lora_B.weight.shape, generator=g))


CFG = {"target_modules": ATTN_MLP, "match_all_linear": False, "dim": 4, "alpha": 8}


def test_linear_lora_forward_matches_float64_reference():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    lora = LinearLoRA.from_linear(base, dim=3, alpha=6.0)
    assert lora.weight is base.weight and lora.bias is base.bias  # no copy of the base weight
    assert lora.lora_A.weight.shape == (3, 6) and lora.lora_B.weight.shape == (5, 3)
    assert torch.equal(lora.lora_B.weight, torch.zeros(5, 3)) and lora.scale == 2.0
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(4, 6)
    W, b = base.weight.double(), base.bias.double()
    A, B = lora.lora_A.weight.double(), lora.lora_B.weight.double()
    expected = x.double() @ W.T + b + 2.0 * (x.double() @ A.T) @ B.T
    torch.testing.assert_close(lora(x), expected.float())
    assert not lora.weight.requires_grad and lora.lora_A.weight.requires_grad


@pytest.mark.parametrize("init", ["xavier", "uniform"])
def test_adapters_are_fp32_with_the_configured_init_even_on_a_bf16_base(init):
    torch.manual_seed(0)
    base = nn.Linear(64, 16, dtype=torch.bfloat16)
    lora = LinearLoRA.from_linear(base, dim=8, alpha=16, lora_A_init=init, use_rslora=True)
    assert lora.lora_A.weight.dtype == lora.lora_B.weight.dtype == torch.float32
    assert lora.scale == pytest.approx(16 / math.sqrt(8))
    a = lora.lora_A.weight
    if init == "uniform":  # kaiming-uniform(a=sqrt(5)) bound is 1/sqrt(fan_in)
        assert a.abs().max() <= 1 / math.sqrt(64) and a.abs().max() > 0.5 / math.sqrt(64)
    else:  # xavier-normal std = sqrt(2 / (fan_in + fan_out))
        assert abs(a.std().item() - math.sqrt(2 / 72)) < 0.3 * math.sqrt(2 / 72)


def test_adapter_path_runs_in_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    lora = LinearLoRA.from_linear(nn.Linear(16, 8), dim=4, alpha=4.0)
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora(x)
        base = F.linear(x, lora.weight, lora.bias)
    delta = F.linear(F.linear(x, lora.lora_A.weight), lora.lora_B.weight)  # fp32
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, base + delta.to(torch.bfloat16))


@pytest.mark.parametrize("position", ["pre", "post"])
def test_dropout_position(position):
    torch.manual_seed(0)
    lora = LinearLoRA.from_linear(
        nn.Linear(16, 8), dim=4, alpha=4.0, dropout=0.5, dropout_position=position
    )
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(3, 16)
    A, B = lora.lora_A.weight, lora.lora_B.weight
    torch.manual_seed(7)
    y = lora(x)
    torch.manual_seed(7)
    if position == "pre":
        expected = F.linear(x, lora.weight, lora.bias) + F.linear(F.linear(F.dropout(x, 0.5), A), B)
    else:
        expected = F.linear(x, lora.weight, lora.bias) + F.dropout(F.linear(F.linear(x, A), B), 0.5)
    torch.testing.assert_close(y, expected)
    lora.eval()
    torch.testing.assert_close(
        lora(x), F.linear(x, lora.weight, lora.bias) + F.linear(F.linear(x, A), B)
    )


def test_zero_b_model_is_bit_identical_to_base(model_dir):
    model, tokens = _load(model_dir), _tokens()
    before = _logits(model, tokens)
    names = apply_lora(model, CFG)
    assert len(names) == 2 * len(ATTN_MLP)
    assert torch.equal(_logits(model, tokens), before)


def test_only_adapters_change_during_training(model_dir):
    model = _load(model_dir)
    apply_lora(model, CFG)
    model.train()
    frozen = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    params = lora_parameters(model)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    tokens = _tokens(seed=3)
    for _ in range(3):
        loss = F.cross_entropy(
            model(input_ids=tokens).logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    assert all(m.lora_B.weight.abs().sum() > 0 for m in lora_modules(model).values())


def _merged_copy(model_dir, lora_model):
    merged = _load(model_dir)
    state = lora_model.state_dict()
    modules = lora_modules(lora_model)
    assert_lora_modules_reachable(modules, state)
    with torch.no_grad():
        for name, m in modules.items():
            w = merge_lora_weight(
                state[f"{name}.weight"], m.lora_A.weight, m.lora_B.weight, m.scale
            )
            merged.get_submodule(name).weight.copy_(w)
    return merged


def test_merged_base_model_gives_the_lora_logits(model_dir):
    model, tokens = _load(model_dir), _tokens()
    apply_lora(model, {**CFG, "use_rslora": True})
    _randomize_b(model)
    lora_logits = _logits(model, tokens)
    assert not torch.allclose(lora_logits, _logits(_load(model_dir), tokens), atol=1e-3)
    torch.testing.assert_close(
        _logits(_merged_copy(model_dir, model), tokens), lora_logits, atol=1e-5, rtol=1e-5
    )


def test_under_bf16_autocast_the_lora_model_scores_bit_for_bit_like_the_refit_model(model_dir):
    """What an RL loop needs from LoRA: the trainer's logits are the inference engine's logits
    on the refit weights (merged in fp32, then cast), not merely close to them."""
    model, tokens = _load(model_dir), _tokens()
    apply_lora(model, {**CFG, "compute_dtype": "bfloat16"})
    _randomize_b(model)
    refit_model = _merged_copy(model_dir, model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(input_ids=tokens).logits, refit_model(input_ids=tokens).logits
    assert torch.equal(got, want)


def test_peft_loads_our_adapter_folder_with_the_same_logits(model_dir, tmp_path):
    from peft import PeftModel

    model, tokens = _load(model_dir), _tokens()
    apply_lora(
        model,
        {
            "match_all_linear": True,
            "exclude_modules": ["re:.*layers\\.1\\.mlp\\..*"],
            "dim": 4,
            "alpha": 16,
            "dropout": 0.1,
        },
    )
    _randomize_b(model)
    model.eval()
    folder = save_peft_adapter(
        model, tmp_path / "adapter", lora_cfg=CFG, base_model_name_or_path=model_dir
    )
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (
        config["r"] == 4
        and config["lora_alpha"] == 16
        and "lm_head" not in config["target_modules"]
    )
    peft_model = PeftModel.from_pretrained(_load(model_dir), str(folder)).eval()
    torch.testing.assert_close(
        _logits(peft_model, tokens), _logits(model, tokens), atol=1e-5, rtol=1e-5
    )
    # and our own loader reads it back into a fresh model
    fresh = _load(model_dir)
    assert load_peft_adapter(fresh, folder) == sorted(lora_modules(model))
    assert torch.equal(_logits(fresh, tokens), _logits(model, tokens))


def test_our_loader_reads_a_folder_written_by_peft(model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        use_rslora=True,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(_load(model_dir), config).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    tokens = _tokens()
    ours = _load(model_dir)
    names = load_peft_adapter(ours, tmp_path / "peft")
    assert len(names) == 6 and all(n.endswith(("q_proj", "v_proj", "down_proj")) for n in names)
    assert all(m.scale == pytest.approx(8 / 2) for m in lora_modules(ours).values())
    torch.testing.assert_close(
        _logits(ours.eval(), tokens), _logits(peft_model, tokens), atol=1e-5, rtol=1e-5
    )
    # loading into a model that already has the same LoRA modules copies in place
    again = _load(model_dir)
    apply_lora(
        again,
        {"target_modules": ["q_proj", "v_proj", "down_proj"], "match_all_linear": False, "dim": 4},
    )
    before = lora_parameters(again)
    load_peft_adapter(again, tmp_path / "peft")
    assert [id(p) for p in lora_parameters(again)] == [id(p) for p in before]
    torch.testing.assert_close(_logits(again.eval(), tokens), _logits(ours, tokens), atol=0, rtol=0)


def test_loading_a_mismatched_adapter_names_the_keys(model_dir, tmp_path):
    model = _load(model_dir)
    apply_lora(model, {"target_modules": ["q_proj"], "match_all_linear": False, "dim": 4})
    save_peft_adapter(model, tmp_path / "a", base_model_name_or_path=model_dir)
    other_dim = _load(model_dir)
    apply_lora(other_dim, {"target_modules": ["q_proj"], "match_all_linear": False, "dim": 2})
    with pytest.raises(
        ValueError, match=r"shape mismatches \['model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight"
    ):
        load_peft_adapter(other_dim, tmp_path / "a")
    more = _load(model_dir)
    apply_lora(more, {"target_modules": ["q_proj", "k_proj"], "match_all_linear": False, "dim": 4})
    with pytest.raises(
        ValueError, match=r"missing keys \['model\.layers\.0\.self_attn\.k_proj\.lora_A\.weight"
    ):
        load_peft_adapter(more, tmp_path / "a")
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_peft_adapter(_load(model_dir), tmp_path)


def test_renamed_module_raises_lora_merge_error_naming_it(model_dir):
    model = _load(model_dir)
    apply_lora(model, CFG)
    keys = [
        k.replace("layers.1.self_attn.o_proj", "layers.1.self_attn.out_proj")
        for k in model.state_dict()
    ]
    with pytest.raises(
        LoRAMergeError, match=r"(?s)1 LoRA module.*'model\.layers\.1\.self_attn\.o_proj': no key"
    ):
        assert_lora_modules_reachable(lora_modules(model), keys)


def test_matching_rules_with_regex_and_exclude(model_dir):
    model = _load(model_dir)
    names = apply_lora(
        model,
        {
            "target_modules": [r"re:.*\.layers\.0\.self_attn\.[qk]_proj", "down_proj"],
            "exclude_modules": ["layers.1.mlp.down_proj"],
            "match_all_linear": False,
        },
    )
    assert names == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert set(lora_modules(model)) == set(names)
    everything = apply_lora(_load(model_dir), {"match_all_linear": True})
    assert len(everything) == 14 and "lm_head" not in everything


def test_apply_lora_accepts_the_config_object(model_dir):
    from policyworker.config import LoRAConfig

    model = _load(model_dir)
    names = apply_lora(
        model, LoRAConfig(target_modules=("v_proj",), match_all_linear=False, dim=2, alpha=4.0)
    )
    assert names == ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"]
    assert all(m.dim == 2 and m.scale == 2.0 for m in lora_modules(model).values())


def test_apply_lora_errors_name_the_config(model_dir):
    with pytest.raises(ValueError, match=r"matching no linear module: \['qproj'\]"):
        apply_lora(_load(model_dir), {"target_modules": ["qproj"], "match_all_linear": False})
    with pytest.raises(
        ValueError, match=r"target_modules=\['q_proj'\], exclude_modules=\['q_proj'\].*selected: 0"
    ):
        apply_lora(
            _load(model_dir),
            {
                "target_modules": ["q_proj"],
                "exclude_modules": ["q_proj"],
                "match_all_linear": False,
            },
        )
    with pytest.raises(ValueError, match=r"unknown lora_cfg key\(s\) \['rank'\]"):
        apply_lora(_load(model_dir), {"rank": 8})
    model = _load(model_dir)
    assert apply_lora(model, {"enabled": False, "target_modules": ["q_proj"]}) == []
    assert not lora_modules(model)
    apply_lora(model, CFG)
    with pytest.raises(ValueError, match="already has LinearLoRA"):
        apply_lora(model, CFG)


# ---- tensor parallel on gloo: tp=2 with LoRA == tp=1 ---------------------------------------------


class _GatedMLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj, self.up_proj = (
            nn.Linear(hidden, inner, bias=False),
            nn.Linear(hidden, inner),
        )
        self.down_proj = nn.Linear(inner, hidden)

    def forward(self, x):
        return x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _TinyTransformerMLP(nn.Module):
    """Embedding, two gated MLP blocks (colwise gate/up, rowwise down under TP), a head."""

    def __init__(self, vocab=64, hidden=32, inner=48):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([_GatedMLP(hidden, inner) for _ in range(2)])
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _tp_rank(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    reference = _TinyTransformerMLP()
    apply_lora(
        reference, {"match_all_linear": True, "exclude_modules": ["head"], "dim": 4, "alpha": 8}
    )
    _randomize_b(reference)
    model = copy.deepcopy(reference)
    plan = {
        "layers.*.gate_proj": ColwiseParallel(),
        "layers.*.up_proj": ColwiseParallel(),
        "layers.*.down_proj": RowwiseParallel(),
    }
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), lora_tp_plan(plan))
    up, down = model.layers[0].up_proj, model.layers[0].down_proj
    assert [p.dim for p in up.weight.placements] == [0] and up.lora_B.weight.placements[0].dim == 0
    assert up.lora_A.weight.placements[0].is_replicate() and isinstance(up, LinearLoRA)
    assert (
        down.lora_A.weight.placements[0].dim == 1
        and down.lora_B.weight.placements[0].is_replicate()
    )
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    logits = []
    for m in (reference, model):
        out = m(tokens)
        F.cross_entropy(out[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        logits.append(out.detach())
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    for (name, ref), got in zip(
        lora_modules(reference).items(), lora_modules(model).values(), strict=True
    ):
        for ref_p, got_p in (
            (ref.lora_A.weight, got.lora_A.weight),
            (ref.lora_B.weight, got.lora_B.weight),
        ):
            torch.testing.assert_close(
                got_p.grad.full_tensor(), ref_p.grad, atol=1e-5, rtol=1e-5, msg=name
            )
        merged = merge_lora_weight(
            got.weight.full_tensor(),
            got.lora_A.weight.full_tensor(),
            got.lora_B.weight.full_tensor(),
            got.scale,
        )
        torch.testing.assert_close(
            merged,
            merge_lora_weight(ref.weight, ref.lora_A.weight, ref.lora_B.weight, ref.scale),
        )
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in reference.named_parameters() if p.requires_grad
    }
    # both ranks done talking before either tears gloo down: a rank that closed its pairs
    # while the other's last all-gather was still draining aborted it once (std::terminate)
    dist.barrier()


@pytest.mark.distributed
def test_tp2_lora_matches_single_process():
    """Adapters sharded by lora_tp_plan give tp=1 logits, adapter grads and merged weights.

    Through the suite's gloo harness (forked ranks, which leave by ``os._exit``): spawned ranks
    ran interpreter finalization after the process group was gone, and one aborted there once in
    a few suite runs (std::terminate, no traceback) after every check had passed."""
    run_on_gloo(_tp_rank, 2)


# ---------------------------------------------------------------------------- compute dtype

# bf16 keeps 8 mantissa bits (eps 2**-8 ~ 3.9e-3): the input, A and B are each rounded once and
# the two small matmuls accumulate in fp32 inside the kernel, so the adapter delta is within a
# few eps of its fp32 value relative to its own largest magnitude. 2e-2 leaves room for that.
BF16_DELTA_RTOL = 2e-2


def test_compute_dtype_key_reaches_every_adapter(model_dir):
    model = _load(model_dir)
    names = apply_lora(model, {**CFG, "compute_dtype": "bfloat16"})
    modules = lora_modules(model)
    assert sorted(modules) == sorted(names)
    assert {m.compute_dtype for m in modules.values()} == {torch.bfloat16}
    assert {p.dtype for p in lora_parameters(model)} == {torch.float32}  # parameters stay fp32


def test_auto_compute_dtype_is_float32_on_cpu_even_under_bf16_autocast(model_dir):
    model = _load(model_dir)
    apply_lora(model, CFG, autocast_dtype=torch.bfloat16)
    assert {m.compute_dtype for m in lora_modules(model).values()} == {torch.float32}


@pytest.mark.parametrize(
    ("device", "base_dtype", "expected"),
    [
        ("cuda", torch.bfloat16, torch.bfloat16),
        ("cuda", torch.float32, torch.float32),
        ("cpu", torch.bfloat16, torch.float32),
    ],
)
def test_auto_compute_dtype_is_bf16_only_on_cuda_with_bf16_base(device, base_dtype, expected):
    got = resolve_compute_dtype("auto", device=torch.device(device), base_dtype=base_dtype)
    assert got == expected


def test_unknown_compute_dtype_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"compute_dtype 'fp8' must be 'auto' or one of"):
        apply_lora(nn.Sequential(nn.Linear(4, 4)), {**CFG, "compute_dtype": "fp8"})


def test_bf16_compute_on_cpu_stays_within_tolerance_of_fp32():
    torch.manual_seed(0)
    base = nn.Linear(64, 48)
    fp32 = LinearLoRA.from_linear(base, dim=8, alpha=16.0, compute_dtype=torch.float32)
    bf16 = LinearLoRA.from_linear(base, dim=8, alpha=16.0, compute_dtype=torch.bfloat16)
    with torch.no_grad():
        fp32.lora_B.weight.normal_()
        bf16.lora_A.weight.copy_(fp32.lora_A.weight)
        bf16.lora_B.weight.copy_(fp32.lora_B.weight)
    x = torch.randn(5, 64)
    y32, y16 = fp32(x), bf16(x)
    assert y16.dtype == torch.float32  # added in the base output's dtype
    delta32 = y32 - F.linear(x, base.weight, base.bias)
    scale = float(delta32.detach().abs().max())
    torch.testing.assert_close(y16, y32, rtol=BF16_DELTA_RTOL, atol=BF16_DELTA_RTOL * scale)
    assert not torch.equal(y16, y32)  # the bf16 path really ran
    y16.square().sum().backward()
    assert bf16.lora_A.weight.grad is not None and bf16.lora_A.weight.grad.dtype == torch.float32


def test_merge_with_bf16_compute_is_the_exact_fp32_merge(model_dir):
    fast, exact = _load(model_dir), _load(model_dir)
    apply_lora(fast, {**CFG, "compute_dtype": "bfloat16"})
    apply_lora(exact, {**CFG, "compute_dtype": "float32"})
    exact.load_state_dict(fast.state_dict())
    _randomize_b(fast)
    _randomize_b(exact)
    state_fast, state_exact = fast.state_dict(), exact.state_dict()
    for name, m in lora_modules(fast).items():
        e = lora_modules(exact)[name]
        merged = merge_lora_weight(
            state_fast[f"{name}.weight"], m.lora_A.weight, m.lora_B.weight, m.scale
        )
        reference = merge_lora_weight(
            state_exact[f"{name}.weight"], e.lora_A.weight, e.lora_B.weight, e.scale
        )
        assert merged.dtype == torch.float32 and torch.equal(merged, reference)
        w64 = state_fast[f"{name}.weight"].double()
        a64, b64 = m.lora_A.weight.double(), m.lora_B.weight.double()
        torch.testing.assert_close(merged, (w64 + m.scale * b64 @ a64).float())


@pytest.mark.parametrize(
    ("dropout", "position"), [(0.0, "pre"), (0.3, "pre"), (0.0, "post"), (0.3, "post")]
)
def test_bf16_adapters_under_bf16_autocast_match_the_general_formula(dropout, position):
    """Under autocast in the adapter's dtype the forward casts the input once and merges the
    adapter into the base weight (no dropout) or adds the up-projection inside an addmm; values
    and gradients stay those of base + scale * (h A^T) B^T computed op by op (within bf16
    rounding)."""
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    lora = LinearLoRA.from_linear(
        base, dim=4, alpha=8.0, dropout=dropout, dropout_position=position,
        compute_dtype=torch.bfloat16,
    )  # fmt: skip
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(3, 5, 24, requires_grad=True)

    def run(module_forward):
        torch.manual_seed(1)  # the same dropout mask in both runs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module_forward(x)
        grads = torch.autograd.grad(
            out.float().square().sum(), [x, lora.lora_A.weight, lora.lora_B.weight]
        )
        return out, grads

    def general(inp):
        bf = torch.bfloat16
        h = lora.dropout(inp) if position == "pre" else inp
        delta = F.linear(
            F.linear(h.to(bf), lora.lora_A.weight.to(bf)) * lora.scale, lora.lora_B.weight.to(bf)
        )
        if position == "post":
            delta = lora.dropout(delta)
        return F.linear(inp, lora.weight, lora.bias) + delta

    out, grads = run(lora)
    want, want_grads = run(general)
    assert out.dtype == want.dtype == torch.bfloat16 and out.shape == (3, 5, 40)
    torch.testing.assert_close(out.float(), want.float(), atol=0.1, rtol=0.02)
    for got, ref in zip(grads, want_grads, strict=True):  # sums of products: compare as a whole
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 0.02


def test_the_merged_path_runs_only_under_autocast_in_the_adapter_dtype(monkeypatch):
    lora = LinearLoRA.from_linear(nn.Linear(8, 6), dim=2, alpha=2.0, compute_dtype=torch.bfloat16)
    merged = []
    original = _MergedAdapterLinear.apply
    monkeypatch.setattr(
        _MergedAdapterLinear, "apply", lambda *a: merged.append(True) or original(*a)
    )
    x = torch.randn(2, 8)
    lora(x)  # no autocast: the general path (fp32 base, bf16 adapter)
    with torch.autocast("cpu", dtype=torch.float16):
        lora(x)  # autocast in another dtype
    assert merged == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lora(x)
    assert merged == [True]


@pytest.mark.parametrize("position", ["pre", "post"])
def test_dropout_keeps_the_adapter_apart_in_training_and_merges_in_eval(monkeypatch, position):
    lora = LinearLoRA.from_linear(
        nn.Linear(8, 6), dim=2, alpha=2.0, dropout=0.5, dropout_position=position,
        compute_dtype=torch.bfloat16,
    )  # fmt: skip
    merged = []
    original = _MergedAdapterLinear.apply
    monkeypatch.setattr(
        _MergedAdapterLinear, "apply", lambda *a: merged.append(True) or original(*a)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lora(torch.randn(2, 8))
        assert merged == []
        lora.eval()
        lora(torch.randn(2, 8))
    assert merged == [True]
    assert lora.merged_weights(torch.bfloat16) is not None
    assert lora.train().merged_weights(torch.bfloat16) is None


def _bf16_lora(in_features=24, out_features=40, bias=True):
    torch.manual_seed(0)
    lora = LinearLoRA.from_linear(
        nn.Linear(in_features, out_features, bias=bias), dim=4, alpha=8.0,
        compute_dtype=torch.bfloat16,
    )  # fmt: skip
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    return lora


@pytest.mark.parametrize("bias", [True, False])
def test_without_dropout_the_forward_uses_the_refit_weights_bit_for_bit(bias):
    """The trainer scores with the weights an engine gets at refit: the fp32 merge cast to bf16."""
    lora = _bf16_lora(bias=bias)
    x = torch.randn(3, 5, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora(x)
    merged = merge_lora_weight(lora.weight, lora.lora_A.weight, lora.lora_B.weight, lora.scale)
    engine_bias = None if lora.bias is None else lora.bias.to(torch.bfloat16)
    engine = F.linear(x.to(torch.bfloat16), merged.to(torch.bfloat16), engine_bias)
    assert out.dtype == torch.bfloat16 and torch.equal(out, engine)


def test_the_merged_layer_has_the_exact_gradients_of_its_formula():
    """In float64 (no rounding to hide behind) against numerical differentiation."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, generator=g, dtype=torch.float64)
    bias = torch.randn(4, generator=g, dtype=torch.float64)
    a = torch.randn(2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, a, b: _MergedAdapterLinear.apply(x, w, bias, a, b, 0.7), (x, a, b)
    )
    out = _MergedAdapterLinear.apply(x, w, bias, a, b, 0.7)
    torch.testing.assert_close(out, F.linear(x, w + 0.7 * b @ a, bias), rtol=1e-12, atol=1e-12)


def test_an_input_that_takes_no_gradient_still_trains_the_adapters():
    """The first layer's input comes from a frozen embedding: no dx, but dA and dB."""
    lora = _bf16_lora()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora(torch.randn(6, 24))
    out.float().square().sum().backward()
    assert lora.lora_A.weight.grad is not None and lora.lora_B.weight.grad is not None
    assert lora.weight.grad is None and lora.bias.grad is None


def test_an_unfrozen_base_keeps_the_path_that_gives_it_gradients():
    lora = _bf16_lora()
    lora.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora(torch.randn(6, 24))
    out.float().sum().backward()
    assert lora.weight.grad is not None and lora.lora_B.weight.grad is not None


def test_compiled_merged_layer_merges_by_the_refits_gemm_and_matches_eager(monkeypatch):
    """torch.compile merges by the same fp32 GEMM as eager code and the refit (no reduction of
    its own: that ran 7x slower on a GPU), so the merged weight is the refit's, bit for bit; the
    outputs and gradients agree with eager within bf16 compute noise (inductor may order the bf16
    GEMMs' sums otherwise)."""
    import policyworker.shell.model.lora as lora_module

    traced = []
    gemm_merge = lora_module.merge_lora_weight
    monkeypatch.setattr(
        lora_module, "merge_lora_weight", lambda *args: traced.append(True) or gemm_merge(*args)
    )
    lora = _bf16_lora(in_features=64, out_features=48)
    x = torch.randn(4, 16, 64)

    def run(forward):
        lora.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(x)
        out.float().square().sum().backward()
        return out.float(), lora.lora_A.weight.grad.clone(), lora.lora_B.weight.grad.clone()

    torch._dynamo.reset()
    compiled = run(torch.compile(lora.forward, fullgraph=True))
    assert traced  # the compiled graph merged by the GEMM
    eager = run(lora.forward)
    torch.testing.assert_close(compiled[0], eager[0], atol=0.05, rtol=0.016)
    for got, want in zip(compiled[1:], eager[1:], strict=True):
        assert float((got - want).norm() / want.norm()) < 0.02

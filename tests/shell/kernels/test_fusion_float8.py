"""The layer compile over float8 linears (`dtensor_cfg.fp8`): the start-up probe compares the
compiled layer with the eager one in norm, since float8 rounding flips single elements."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from policyworker.config import Float8Config
from policyworker.shell.kernels import fusion_probe
from policyworker.shell.kernels.fusion import fuse_elementwise
from policyworker.shell.model import float8 as float8_lib
from policyworker.shell.model.lora import apply_lora
from tests.helpers import save_float8_tiny_qwen2

LAYER = torch.nn.Linear(4, 4)


def _check(got: torch.Tensor, expected: torch.Tensor) -> None:
    fusion_probe._assert_close(LAYER, "gradients", [got], [expected], torch.bfloat16, float8=True)


def test_float8_probe_accepts_single_elements_off_by_a_float8_step():
    """One element off by 15% of the largest magnitude (a flipped e5m2 rounding) fails the bf16
    check but is float8 noise: the norm check passes it."""
    expected = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    got = expected.clone()
    got.view(-1)[7] += 0.15 * float(expected.abs().max())
    with pytest.raises(RuntimeError, match="differ by more than rtol=0.02"):
        fusion_probe._assert_close(LAYER, "gradients", [got], [expected], torch.bfloat16)
    _check(got, expected)


@pytest.mark.parametrize("broken", ["doubled", "zeros", "nan"])
def test_float8_probe_rejects_what_a_broken_compile_gives(broken):
    expected = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    got = {
        "doubled": 2 * expected,
        "zeros": torch.zeros_like(expected),
        "nan": expected.masked_fill(expected > 1, float("nan")),
    }[broken]
    with pytest.raises(RuntimeError, match="with float8 GEMMs: gradients differ"):
        _check(got, expected)


@pytest.mark.slow  # two layer compiles on the CPU: about a minute
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_compiled_float8_layers_pass_the_probe_under_bf16_autocast(tmp_path, lora):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    path = save_float8_tiny_qwen2(tmp_path / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        apply_lora(model, {"match_all_linear": True, "dim": 4, "alpha": 8})
    report = float8_lib.apply_float8_training(
        model, Float8Config(), device=torch.device("cpu"), check_device=False
    )
    assert report.active
    fusion = fuse_elementwise(model, mode="layer", autocast_dtype=torch.bfloat16, float8=True)
    assert fusion.fallback_reason is None and fusion.fused_layers == 2
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert torch.isfinite(loss)

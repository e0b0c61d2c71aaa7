"""Losses are called as NeMo-RL calls them: all by keyword, inputs by the loss's input type.

A loss written against NeMo-RL's LossFunction interface (its parameter order, its keyword names,
NeMo-RL's helpers) trains unchanged but for its imports; on-policy distillation runs end to end
with a teacher worker's top-k logits feeding a student worker's DistillationLossFn.
"""

import math

import pytest
import torch

from policyworker.functional.distillation import (
    DistillationLossConfig,
    DistillationLossFn,
    distillation_topk_logprobs,
)
from policyworker.functional.loss import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    LossInputType,
    LossType,
    NLLLoss,
    NLLLossFn,
    calculate_kl,
    masked_mean,
)
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config


class NeMoRLShapedNLL:
    """NeMo-RL's NLL loss as its users write one: `next_token_logprobs` first, `data` after it,
    NeMo-RL's masked_mean keywords. Only the imports above differ from NeMo-RL."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
        loss = -masked_mean(
            next_token_logprobs, mask, global_normalization_factor=global_valid_toks
        )
        return loss, {
            "loss": loss.item(),
            "num_unmasked_tokens": mask.sum().item(),
            "num_valid_samples": data["sample_mask"].sum().item(),
        }


class NeMoRLShapedLogitLoss:
    """A LOGIT loss in NeMo-RL's shape (`logits` first); a per-row mean over dim=-1."""

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGIT

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks):
        mask = data["token_mask"][:, 1:]
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
            -1, data["input_ids"][:, 1:, None]
        )[..., 0]
        per_row = masked_mean(lp, mask, dim=-1)
        loss = -masked_mean(
            per_row, data["sample_mask"], global_normalization_factor=global_valid_seqs
        )
        return loss, {"loss": loss.item(), "num_valid_samples": data["sample_mask"].sum().item()}


def _train(path, loss_fn, steps=2, **extra):
    worker = PolicyWorker(make_config(path, **extra), init_reference_model=False)
    data = make_batch(8, 12, seed=5, lengths=[12, 5, 9, 3, 12, 7, 2, 10])
    results = [worker.train(data, loss_fn) for _ in range(steps)]
    return [r["global_loss"] for r in results], [r["grad_norm"] for r in results]


@pytest.mark.parametrize(
    "extra", [{}, {"sequence_packing": {"train_mb_tokens": 24}}], ids=["fixed", "packed"]
)
def test_a_nemo_rl_shaped_loss_trains_like_ours(tiny_model_paths, extra):
    ours = _train(tiny_model_paths["llama"], NLLLoss(), **extra)
    theirs = _train(tiny_model_paths["llama"], NeMoRLShapedNLL(), **extra)
    for a, b in zip(ours[0], theirs[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ours[1] == pytest.approx(theirs[1], rel=1e-6)
    assert NLLLossFn is NLLLoss


def test_a_nemo_rl_shaped_logit_loss_trains(tiny_model_paths):
    losses, norms = _train(tiny_model_paths["llama"], NeMoRLShapedLogitLoss(), steps=3)
    assert all(math.isfinite(float(x.sum())) for x in losses) and all(n > 0 for n in norms)
    assert float(losses[-1].sum()) < float(losses[0].sum())


def test_loss_configs_accept_nemo_rl_config_objects():
    class PydanticLike:  # NeMo-RL's loss configs are pydantic models: model_dump() gives keys
        def model_dump(self):
            return {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.1}

    assert ClippedPGLossFn(ClippedPGLossConfig()).cfg == ClippedPGLossConfig()
    assert ClippedPGLossFn(PydanticLike()).cfg.ratio_clip_min == 0.1
    assert ClippedPGLossFn({"ratio_clip_max": 0.3}).cfg.ratio_clip_max == 0.3
    assert DistillationLossFn(DistillationLossConfig(kl_type="forward")).kl_type == "forward"
    with pytest.raises(ValueError, match="must be a mapping, an attrs/dataclass instance"):
        ClippedPGLossFn(3)


def test_masked_mean_and_calculate_kl_have_nemo_rl_signatures():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(
        masked_mean(x, m, dim=-1),
        torch.tensor([1.5, 4.0]) * (torch.tensor([2.0, 1.0]) / (torch.tensor([2.0, 1.0]) + 1e-8)),
    )
    torch.testing.assert_close(masked_mean(x, m, -1), masked_mean(x, m, dim=-1))
    torch.testing.assert_close(
        masked_mean(x, m, global_normalization_factor=7.0), torch.tensor(7.0 / (7.0 + 1e-8))
    )
    logr = torch.tensor([[0.5, -30.0]])
    kl = calculate_kl(torch.zeros_like(logr), logr, "k3", 20.0, 10.0)
    expected = torch.tensor([[math.exp(0.5) - 1 - 0.5, math.exp(-20.0) - 1 + 20.0]]).clamp(max=10)
    torch.testing.assert_close(kl, expected)
    with pytest.raises(ValueError, match="kl_type 'k4'"):
        calculate_kl(logr, logr, "k4")


def _teacher_topk_batch(teacher, k):
    data = make_batch(4, 10, seed=21, lengths=[10, 6, 8, 4])
    top = teacher.get_topk_logits(data, k=k)
    return {
        **data,
        "teacher_topk_logits": top["topk_logits"],
        "teacher_topk_indices": top["topk_indices"],
    }


@pytest.mark.parametrize(
    ("kl_type", "zero_outside_topk"), [("forward", False), ("reverse", True), ("mixed", True)]
)
def test_on_policy_distillation_runs_end_to_end_with_two_workers(
    tiny_model_paths, kl_type, zero_outside_topk
):
    teacher = PolicyWorker(make_config(tiny_model_paths["qwen2"]), init_reference_model=False)
    student = PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)
    batch = _teacher_topk_batch(teacher, k=4)
    assert batch["teacher_topk_logits"].shape == (4, 10, 4)
    loss_fn = DistillationLossFn(
        {"kl_type": kl_type, "mixed_kl_weight": 0.5, "zero_outside_topk": zero_outside_topk}
    )
    # the first step's loss equals the loss computed directly from the student's logits
    with torch.no_grad():
        logits = student.model(input_ids=batch["input_ids"]).logits
    s, t, h = distillation_topk_logprobs(
        logits,
        batch["teacher_topk_logits"],
        batch["teacher_topk_indices"],
        zero_outside_topk=zero_outside_topk,
        calculate_entropy=zero_outside_topk,
    )
    valid = (torch.arange(10)[None] < batch["input_lengths"][:, None]).float()
    gvt = (batch["token_mask"][:, 1:] * valid[:, 1:]).sum()
    direct, _ = loss_fn(
        data=batch,
        global_valid_seqs=torch.tensor(4.0),
        global_valid_toks=gvt,
        student_topk_logprobs=s,
        teacher_topk_logprobs=t,
        H_all=h,
    )
    losses = [float(student.train(batch, loss_fn)["global_loss"].sum()) for _ in range(4)]
    assert losses[0] == pytest.approx(float(direct), rel=1e-4)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_distillation_kl_is_zero_when_student_equals_teacher_and_mixes_linearly():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    top = torch.topk(logits, 3, dim=-1)
    s, t, _ = distillation_topk_logprobs(
        logits, top.values, top.indices, zero_outside_topk=False, calculate_entropy=False
    )
    data = {
        "token_mask": torch.ones(2, 5),
        "sample_mask": torch.ones(2),
        "input_ids": torch.zeros(2, 5, dtype=torch.long),
    }
    for kind in ("forward", "reverse", "mixed"):
        loss, _ = DistillationLossFn({"kl_type": kind})(
            data=data,
            global_valid_seqs=2,
            global_valid_toks=8,
            student_topk_logprobs=s,
            teacher_topk_logprobs=t,
            H_all=None,
        )
        assert abs(float(loss)) < 1e-6
    shifted = s + torch.randn(s.shape, generator=gen) * 0.3
    parts = {
        kind: DistillationLossFn({"kl_type": kind, "mixed_kl_weight": 0.25})(
            data=data,
            global_valid_seqs=2,
            global_valid_toks=8,
            student_topk_logprobs=shifted,
            teacher_topk_logprobs=t,
        )[0]
        for kind in ("forward", "reverse", "mixed")
    }
    torch.testing.assert_close(parts["mixed"], 0.25 * parts["forward"] + 0.75 * parts["reverse"])

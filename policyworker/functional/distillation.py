"""On-policy distillation: the student's KL against the teacher's top-k logits, NeMo-RL style.

The teacher worker's ``get_topk_logits(data, k)`` gives ``topk_logits`` / ``topk_indices``
[B, S, K] (every position, no shift); the controller puts them into the student's batch as
``teacher_topk_logits`` / ``teacher_topk_indices``. For each position the student's logprobs are
read at the teacher's K token ids (`distillation_topk_logprobs`) and the loss compares the two
K-point distributions. Shape legend: ``B`` rows, ``S`` positions, ``T = S - 1``, ``V`` vocab,
``K`` top-k. All functions are pure.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, cast

import attrs
import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from policyworker.errors import ConfigError
from policyworker.functional.logprobs import default_chunk_size
from policyworker.functional.loss_inputs import masks_from_data, require_tensor
from policyworker.functional.loss_options import config_mapping, read_config_mapping
from policyworker.functional.loss_protocol import LossInputType, LossType, MetricNormalizer
from policyworker.functional.loss_terms import masked_mean, sanitize

__all__ = [
    "DistillationConfig",
    "DistillationLossConfig",
    "DistillationLossFn",
    "distillation_loss_input",
    "distillation_topk_logprobs",
]

KLDirection = Literal["forward", "reverse", "mixed"]
# log of the probability the top-k-restricted student gives every token outside the teacher's k
# (NeMo-RL's `log_infinitesimal`), used by the zero_outside_topk correction term
LOG_INFINITESIMAL = -100.0


class _LogNormalizerAndPLogP(torch.autograd.Function):
    """Per position of ``x`` = logits in fp32 (or wider): ``lse = logsumexp(x)`` and
    ``plogp = sum_v p log p`` (minus the entropy), a chunk of positions at a time.

    It saves the logits in their own dtype and the two [B, S] results; backward recomputes
    ``log p = x - lse`` per chunk, so no fp32 [B, S, V] tensor outlives a chunk.
    d lse / dx = p and d plogp / dx = p * (log p - plogp). Logits must be finite.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, logits_BSV: Tensor, chunk: int
    ) -> tuple[Tensor, Tensor]:
        wide = torch.promote_types(logits_BSV.dtype, torch.float32)
        lse_BS = logits_BSV.new_empty(logits_BSV.shape[:2], dtype=wide)
        plogp_BS = torch.empty_like(lse_BS)
        for start in range(0, logits_BSV.shape[1], chunk):
            span = slice(start, start + chunk)
            logp = logits_BSV[:, span].detach().to(wide, copy=True)  # scratch: changed in place
            lse_BS[:, span] = torch.logsumexp(logp, dim=-1)
            logp.sub_(lse_BS[:, span, None])
            plogp_BS[:, span] = (torch.exp(logp) * logp).sum(dim=-1)
        ctx.save_for_backward(logits_BSV, lse_BS, plogp_BS)
        ctx.chunk = chunk  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return lse_BS, plogp_BS

    @staticmethod
    # autograd passes one grad per forward output; naming them beats base's *grad_outputs
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: Any, grad_lse_BS: Tensor | None, grad_plogp_BS: Tensor | None
    ) -> tuple[Tensor | None, None]:
        saved = cast(tuple[Tensor, Tensor, Tensor], ctx.saved_tensors)
        logits_BSV, lse_BS, plogp_BS = saved
        if grad_lse_BS is None and grad_plogp_BS is None:
            return None, None
        grad_BSV = torch.empty_like(logits_BSV)
        chunk: int = ctx.chunk
        for start in range(0, logits_BSV.shape[1], chunk):
            span = slice(start, start + chunk)
            logp = logits_BSV[:, span].to(lse_BS.dtype, copy=True).sub_(lse_BS[:, span, None])
            p = torch.exp(logp)
            if grad_plogp_BS is None:
                assert grad_lse_BS is not None
                grad = p.mul_(grad_lse_BS[:, span, None])
            else:  # p * (g_lse + g_plogp * (log p - plogp)), in place on the chunk's scratch
                coef = logp.sub_(plogp_BS[:, span, None]).mul_(grad_plogp_BS[:, span, None])
                if grad_lse_BS is not None:
                    coef.add_(grad_lse_BS[:, span, None])
                grad = p.mul_(coef)
            grad_BSV[:, span] = grad.to(grad_BSV.dtype)
        return grad_BSV, None


def distillation_topk_logprobs(
    student_logits_BSV: Tensor,
    teacher_topk_logits_BSK: Tensor,
    teacher_topk_indices_BSK: Tensor,
    *,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(student_topk_logprobs_BTK, teacher_topk_logprobs_BTK, H_all_BT or None).

    The teacher's K logits are renormalized over the K ids. The student's are the full-vocab
    log-softmax read at those ids when ``zero_outside_topk`` (so they sum to less than 1), else
    the log-softmax of its logits at the K ids. ``H_all`` is Σ_v p·log p over the full vocab
    (only when ``calculate_entropy``). The last position is dropped (it predicts no token).

    Only the K logits are cast up; the full-vocab normalizer and ``H_all`` of
    ``zero_outside_topk`` are computed ``chunk_size`` positions at a time (default
    ``default_chunk_size(V)``), so no fp32 [B, S, V] tensor is made, in forward or backward.
    """
    k = teacher_topk_indices_BSK.shape[-1]
    if k < 1:
        msg = f"topk must be positive: teacher_topk_indices has k = {k}; set topk_logits_k >= 1"
        raise ValueError(msg)
    if teacher_topk_indices_BSK.shape != teacher_topk_logits_BSK.shape or tuple(
        teacher_topk_indices_BSK.shape[:2]
    ) != tuple(student_logits_BSV.shape[:2]):
        msg = (
            f"teacher_topk_logits {tuple(teacher_topk_logits_BSK.shape)} and "
            f"teacher_topk_indices {tuple(teacher_topk_indices_BSK.shape)} must both be "
            f"[B, S, K] with [B, S] = {tuple(student_logits_BSV.shape[:2])} of the student"
        )
        raise ValueError(msg)
    fp32_or_wider = torch.promote_types(student_logits_BSV.dtype, torch.float32)
    ids_BSK = teacher_topk_indices_BSK.to(device=student_logits_BSV.device, dtype=torch.int64)
    # Only the K logits are read: gathered first, then cast up. Their values (and gradient,
    # scattered back in the logits' dtype) are those of casting the whole [B, S, V] block first,
    # without its fp32 copy.
    picked_BSK = student_logits_BSV.gather(-1, ids_BSK).to(fp32_or_wider)
    entropy_BS = None
    if zero_outside_topk:  # the full-vocab normalizer (and entropy), chunk by chunk
        chunk = chunk_size or default_chunk_size(student_logits_BSV.shape[-1])
        # autograd.Function.apply is untyped in torch's stubs
        both: Any = _LogNormalizerAndPLogP.apply(student_logits_BSV, chunk)  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
        lse_BS, plogp_BS = cast(tuple[Tensor, Tensor], both)
        student_BSK = picked_BSK - lse_BS[..., None]
        if calculate_entropy:
            entropy_BS = plogp_BS
    else:
        student_BSK = torch.log_softmax(picked_BSK, dim=-1)
    teacher_BSK = torch.log_softmax(
        teacher_topk_logits_BSK.to(device=student_BSK.device, dtype=student_BSK.dtype), dim=-1
    )
    entropy_BT = None if entropy_BS is None else entropy_BS[:, :-1]
    return student_BSK[:, :-1], teacher_BSK[:, :-1], entropy_BT


@attrs.frozen(kw_only=True)
class DistillationConfig:
    """NeMo-RL's ``loss_fn`` keys for DistillationLossFn, with NeMo-RL's defaults."""

    kl_type: KLDirection = attrs.field(default="mixed", metadata={"kind": "a string"})
    mixed_kl_weight: float = attrs.field(default=0.5, metadata={"kind": "a number"})
    zero_outside_topk: bool = attrs.field(default=False, metadata={"kind": "a bool"})

    @classmethod
    def from_mapping(cls, cfg: Any) -> "DistillationConfig":
        """Build from a ``loss_fn`` mapping or config object; missing keys take the defaults."""
        if isinstance(cfg, cls):
            return cfg
        return cls(
            **read_config_mapping(config_mapping(cfg, "DistillationLossFn"), cls, section="loss_fn")
        )

    def __attrs_post_init__(self) -> None:
        problems: list[str] = []
        if self.kl_type not in ("forward", "reverse", "mixed"):
            problems.append(
                f"kl_type must be 'forward', 'reverse' or 'mixed', got "
                f"{self.kl_type!r} @ loss_fn.kl_type"
            )
        if not 0.0 <= self.mixed_kl_weight <= 1.0:
            problems.append(
                f"mixed_kl_weight must be in [0, 1], got {self.mixed_kl_weight} "
                "@ loss_fn.mixed_kl_weight"
            )
        if problems:
            raise ConfigError("\n".join(problems))


DistillationLossConfig = DistillationConfig  # NeMo-RL's name


class DistillationLossFn:
    """KL between the student and the teacher on the teacher's top-k ids, per token::

        forward = Σ_k p_t (log p_t − log p_s)      reverse = Σ_k p_s (log p_s − log p_t)
        mixed   = w · forward + (1 − w) · reverse  (w = mixed_kl_weight)

    With ``zero_outside_topk`` (and a reverse part) the student keeps its full-vocab mass and
    the tokens outside the top k add ``H_rest − log_infinitesimal · P_rest`` (× (1 − w) when
    mixed).
    The loss is the masked mean over ``token_mask[:, 1:] · sample_mask`` divided by
    ``global_valid_toks``. Called by keyword with NeMo-RL's distillation inputs.
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DISTILLATION
    metric_normalizations: Mapping[str, MetricNormalizer] = MappingProxyType(
        {
            "loss": MetricNormalizer.TOKENS,
            "num_valid_samples": MetricNormalizer.NONE,
        }
    )

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = DistillationConfig.from_mapping(cfg)
        self.kl_type = self.cfg.kl_type
        self.mixed_kl_weight = self.cfg.mixed_kl_weight
        self.zero_outside_topk = self.cfg.zero_outside_topk

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        *,
        student_topk_logprobs: Tensor,
        teacher_topk_logprobs: Tensor,
        H_all: Tensor | None = None,  # noqa: N803 (NeMo-RL's keyword)
    ) -> tuple[Tensor, dict[str, float]]:
        """Loss and metrics of one microbatch (``student_topk_logprobs`` [B, T, K])."""
        owner = "DistillationLossFn"
        student_BTK, teacher_BTK = student_topk_logprobs, teacher_topk_logprobs
        require_tensor(data, "token_mask", owner)
        _, sample_mask_B, mask_BT = masks_from_data(data, student_BTK[..., 0], owner)
        student_p_BTK, teacher_p_BTK = student_BTK.exp(), teacher_BTK.exp()
        forward_BT = (teacher_p_BTK * (teacher_BTK - student_BTK)).sum(-1)
        reverse_BT = (student_p_BTK * (student_BTK - teacher_BTK)).sum(-1)
        w = self.mixed_kl_weight
        if self.kl_type == "forward":
            kl_BT = forward_BT
        elif self.kl_type == "reverse":
            kl_BT = reverse_BT
        else:
            kl_BT = w * forward_BT + (1.0 - w) * reverse_BT
        if self.zero_outside_topk and self.kl_type != "forward":
            if H_all is None:
                msg = (
                    f"{owner}: zero_outside_topk with kl_type {self.kl_type!r} needs H_all "
                    "(the student's full-vocab entropy term)"
                )
                raise ValueError(msg)
            rest_entropy_BT = H_all - (student_p_BTK * student_BTK).sum(-1)
            rest_mass_BT = 1.0 - student_p_BTK.sum(-1)
            correction_BT = rest_entropy_BT - LOG_INFINITESIMAL * rest_mass_BT
            kl_BT = kl_BT + (
                correction_BT * (1.0 - w) if self.kl_type == "mixed" else correction_BT
            )
        kl_BT = sanitize(kl_BT, mask_BT != 0)
        loss = masked_mean(kl_BT, mask_BT, global_normalization_factor=global_valid_toks)
        return loss, {"loss": float(loss.detach()), "num_valid_samples": float(sample_mask_B.sum())}


def distillation_loss_input(
    student_logits_BSV: Tensor, data: Mapping[str, Any], loss_fn: Any
) -> dict[str, Tensor | None]:
    """NeMo-RL's DISTILLATION loss input from the student's logits and the batch's
    ``teacher_topk_logits`` / ``teacher_topk_indices`` [B, S, K]; the entropy is computed only
    when the loss needs it (``zero_outside_topk`` with a reverse part)."""
    owner = type(loss_fn).__name__
    zero_outside_topk = bool(getattr(loss_fn, "zero_outside_topk", False))
    kl_type = getattr(loss_fn, "kl_type", "mixed")
    student, teacher, entropy = distillation_topk_logprobs(
        student_logits_BSV,
        require_tensor(data, "teacher_topk_logits", owner),
        require_tensor(data, "teacher_topk_indices", owner),
        zero_outside_topk=zero_outside_topk,
        calculate_entropy=zero_outside_topk and kl_type != "forward",
    )
    return {"student_topk_logprobs": student, "teacher_topk_logprobs": teacher, "H_all": entropy}

"""The pieces ``loss.py`` is built from: per-token terms (KL estimators, importance-weight
truncation, masked means), input reading/validation, ClippedPG metrics, and the loss configs
(``ClippedPGConfig``, ``DPOConfig``: NeMo-RL keys and defaults). All functions are pure.

Shape legend: ``B`` batch rows, ``T`` next-token positions (``S - 1``). Every ``*_BT`` tensor is
aligned with ``next_token_logprobs``: index ``t`` refers to token ``t + 1`` of the sequence.
Masks may be bool, integer or float; a float mask acts as a weight.

Why it is over 400 lines: it is a table of small independent terms (median 13 lines each)
plus the two loss configs, whose validators list NeMo-RL's keys and defaults field by field;
the terms are kept together because every loss in ``loss.py`` draws on most of them.
"""

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import torch
from torch import Tensor

from policyworker.errors import ConfigError

__all__ = [
    "ClippedPGConfig",
    "DPOConfig",
    "KLType",
    "TruncationType",
    "approx_entropy",
    "js_divergence",
    "kl_estimate",
    "logprobs_input",
    "masked_extremes",
    "masked_mean",
    "masks_from_data",
    "mismatch_metrics",
    "next_token_slice",
    "ratio_metrics",
    "require_tensor",
    "rowwise_masked_mean",
    "sanitize",
    "truncate_importance_weights",
]

KLType = Literal["k1", "k2", "k3"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis"]

MASKED_MEAN_EPS = 1e-8


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    global_normalization_factor: Tensor | float | None = None,
) -> Tensor:
    """``Σ(values·mask) / (factor + 1e-8)`` over ``dim`` (all dims when None); the factor
    defaults to ``mask.sum(dim)``. NeMo-RL's signature, so its losses call it unchanged.

    With the global count as the factor, the sum of this over microbatches is the batch mean.
    """
    mask = mask.to(values.dtype) if mask.dtype == torch.bool else mask
    if global_normalization_factor is None:
        factor = mask.sum() if dim is None else mask.sum(dim=dim)
    else:
        factor = global_normalization_factor
    # `where` keeps a NaN/inf at a masked position out of the sum (0 * inf would be NaN).
    weighted = torch.where(mask != 0, values * mask, 0.0)
    total = weighted.sum() if dim is None else weighted.sum(dim=dim)
    return total / (factor + MASKED_MEAN_EPS)


def rowwise_masked_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-row ``Σ_t(values·mask) / (Σ_t mask + 1e-8)`` -> [B]; a row with no tokens gives 0."""
    mask_BT = mask_BT.to(values_BT.dtype)
    return (values_BT * mask_BT).sum(-1) / (mask_BT.sum(-1) + MASKED_MEAN_EPS)


def sanitize(values: Tensor, keep: Tensor) -> Tensor:
    """``values`` where ``keep`` else 0, so masked positions can be neither NaN nor inf.

    Zeroing the *inputs* (not the outputs) keeps NaN out of the backward pass too: masked
    tokens then receive an exact zero gradient.
    """
    return torch.where(keep, values, 0.0)


def kl_estimate(
    logprobs_BT: Tensor,
    reference_logprobs_BT: Tensor,
    *,
    kl_type: KLType,
    input_clamp: float | None,
    output_clamp: float | None,
    weights_BT: Tensor | None = None,
) -> Tensor:
    """Schulman's per-token estimators of KL(π‖π_ref) on ``logr = ref − logprobs``.

    k1 = −logr, k2 = logr²/2, k3 = exp(logr) − 1 − logr. ``logr`` is clamped to
    ±``input_clamp`` first; the optional sampling ``weights_BT`` multiply the estimate before the
    ±``output_clamp``; where the input clamp is active the weights are detached, so the clamp
    removes the gradient of both factors.
    """
    logr_BT = reference_logprobs_BT - logprobs_BT
    if input_clamp is not None:
        clamped_BT = logr_BT.clamp(min=-input_clamp, max=input_clamp)
        if weights_BT is not None:
            weights_BT = torch.where(clamped_BT == logr_BT, weights_BT, weights_BT.detach())
        logr_BT = clamped_BT
    if kl_type == "k1":
        kl_BT = -logr_BT
    elif kl_type == "k2":
        kl_BT = logr_BT.square() / 2
    else:
        kl_BT = torch.exp(logr_BT) - 1 - logr_BT
    if weights_BT is not None:
        kl_BT = weights_BT * kl_BT
    if output_clamp is not None:
        kl_BT = kl_BT.clamp(min=-output_clamp, max=output_clamp)
    return kl_BT


def js_divergence(logprobs_a_BT: Tensor, logprobs_b_BT: Tensor) -> Tensor:
    """Per-token Jensen-Shannon estimate between two samplers (k3 form against the mixture)."""
    log_mix_BT = torch.logaddexp(logprobs_a_BT, logprobs_b_BT) - math.log(2.0)
    ra_BT, rb_BT = logprobs_a_BT - log_mix_BT, logprobs_b_BT - log_mix_BT
    return 0.5 * (torch.exp(ra_BT) - ra_BT - 1) + 0.5 * (torch.exp(rb_BT) - rb_BT - 1)


def truncate_importance_weights(
    weights: Tensor,
    *,
    kind: TruncationType,
    ratio_max: float,
    ratio_min: float | None,
    seq_log_ratio_mean_B: Tensor,
    mask_BT: Tensor,
    sample_mask_B: Tensor,
    global_valid_toks: Tensor | float,
    global_valid_seqs: Tensor | float,
) -> tuple[Tensor, dict[str, float]]:
    """Apply truncated importance sampling; return the new weights and ``is_oob_ratio``.

    ``tis`` clamps to [ratio_min or 0, ratio_max]; ``icepop`` zeroes weights outside
    [ratio_min, ratio_max]; ``seq-mask-tis`` zeroes whole rows whose geometric-mean ratio
    ``exp(seq_log_ratio_mean_B)`` lies outside [ratio_min, ratio_max] and keeps the others raw.
    ``weights`` is [B, T] (token-level) or [B, 1] (sequence-level).
    """
    with torch.no_grad():
        if kind == "seq-mask-tis":
            assert ratio_min is not None
            geo_mean_B = torch.exp(seq_log_ratio_mean_B)
            kept_B = ((geo_mean_B >= ratio_min) & (geo_mean_B <= ratio_max)).to(weights.dtype)
            oob = masked_mean(
                1.0 - kept_B, sample_mask_B, global_normalization_factor=global_valid_seqs
            )
            return weights * kept_B[:, None], {"is_oob_ratio": float(oob)}
        low = 0.0 if ratio_min is None else ratio_min
        kept = (weights >= low) & (weights <= ratio_max)
        oob_BT = torch.broadcast_to((~kept).to(mask_BT.dtype), mask_BT.shape)
        oob = masked_mean(oob_BT, mask_BT, global_normalization_factor=global_valid_toks)
    if kind == "tis":
        return weights.clamp(min=low, max=ratio_max), {"is_oob_ratio": float(oob)}
    return torch.where(kept, weights, torch.zeros_like(weights)), {"is_oob_ratio": float(oob)}


def masked_extremes(values_BT: Tensor, mask_BT: Tensor) -> tuple[float, float]:
    """(min, max) over positions where ``mask_BT`` is nonzero; (+inf, −inf) when there are none."""
    selected = values_BT.detach()[mask_BT != 0]
    if selected.numel() == 0:
        return math.inf, -math.inf
    return float(selected.min()), float(selected.max())


# ------------------------------------------------------------------------------ loss inputs


def require_tensor(data: Mapping[str, Any], key: str, owner: str) -> Tensor:
    """``data[key]``, or a ValueError naming the missing key and the keys present."""
    if key not in data:
        msg = (
            f"{owner} needs data[{key!r}], which is missing (keys present: {sorted(data)}); "
            f"add it to the batch"
        )
        raise ValueError(msg)
    value = data[key]
    if not isinstance(value, Tensor):
        msg = f"{owner}: data[{key!r}] must be a torch.Tensor, got {type(value).__name__}"
        raise ValueError(msg)
    return value


def logprobs_input(inputs: Mapping[str, Tensor], owner: str) -> Tensor:
    """The ``next_token_logprobs`` keyword input [B, T], promoted to at least float32."""
    if set(inputs) != {"next_token_logprobs"}:
        msg = (
            f"{owner} takes exactly the keyword input next_token_logprobs [B, S-1], got "
            f"{sorted(inputs)}; its input_type is LossInputType.LOGPROB"
        )
        raise ValueError(msg)
    logprobs_BT = inputs["next_token_logprobs"]
    if logprobs_BT.ndim != 2:
        msg = f"{owner}: next_token_logprobs must be [B, S-1], got shape {tuple(logprobs_BT.shape)}"
        raise ValueError(msg)
    return logprobs_BT.to(torch.promote_types(logprobs_BT.dtype, torch.float32))


def next_token_slice(data: Mapping[str, Any], key: str, like_BT: Tensor, owner: str) -> Tensor:
    """``data[key][:, 1:]`` in the dtype of ``like_BT``, after checking it is [B, T + 1]."""
    value_BS = require_tensor(data, key, owner)
    B, T = like_BT.shape
    if tuple(value_BS.shape) != (B, T + 1):
        msg = (
            f"{owner}: data[{key!r}] has shape {tuple(value_BS.shape)} but next_token_logprobs is "
            f"{(B, T)}, so it must be {(B, T + 1)} (per-token tensors are [B, S])"
        )
        raise ValueError(msg)
    return value_BS[:, 1:].to(like_BT.dtype)


def masks_from_data(
    data: Mapping[str, Any], like_BT: Tensor, owner: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(token_mask_BT, sample_mask_B, mask_BT = token_mask · sample_mask) in ``like_BT``'s dtype."""
    token_mask_BT = next_token_slice(data, "token_mask", like_BT, owner)
    sample_mask_B = require_tensor(data, "sample_mask", owner)
    if tuple(sample_mask_B.shape) != (like_BT.shape[0],):
        msg = (
            f"{owner}: data['sample_mask'] has shape {tuple(sample_mask_B.shape)}, "
            f"expected [B] = {(like_BT.shape[0],)}"
        )
        raise ValueError(msg)
    sample_mask_B = sample_mask_B.to(like_BT.dtype)
    return token_mask_BT, sample_mask_B, token_mask_BT * sample_mask_B[:, None]


# ------------------------------------------------------------------------------ PG metrics


def mismatch_metrics(
    prev_BT: Tensor, gen_BT: Tensor, mask_BT: Tensor, *, kl_type: KLType, gvt: Tensor | float
) -> dict[str, float]:
    """Trainer-vs-sampler mismatch: token_mult_prob_error, gen/policy KL, JS divergence."""
    with torch.no_grad():
        prev_BT = prev_BT.detach()
        gen_kl_BT = kl_estimate(
            gen_BT, prev_BT, kl_type=kl_type, input_clamp=None, output_clamp=None
        )
        policy_kl_BT = kl_estimate(
            prev_BT, gen_BT, kl_type=kl_type, input_clamp=None, output_clamp=None
        )
        mult_BT = torch.exp((gen_BT - prev_BT).abs() * mask_BT)
        return {
            "token_mult_prob_error": float(
                masked_mean(mult_BT, mask_BT, global_normalization_factor=gvt)
            ),
            "gen_kl_error": float(masked_mean(gen_kl_BT, mask_BT, global_normalization_factor=gvt)),
            "policy_kl_error": float(
                masked_mean(policy_kl_BT, mask_BT, global_normalization_factor=gvt)
            ),
            "js_divergence_error": float(
                masked_mean(
                    js_divergence(prev_BT, gen_BT), mask_BT, global_normalization_factor=gvt
                )
            ),
        }


def ratio_metrics(
    ratios_BT: Tensor, clamped_BT: Tensor, mask_BT: Tensor, gvt: Tensor | float
) -> dict[str, float]:
    """Mean, min and max of the (clamped) probability ratios over valid tokens."""
    with torch.no_grad():
        r_min, r_max = masked_extremes(ratios_BT, mask_BT)
        c_min, c_max = masked_extremes(clamped_BT, mask_BT)
        return {
            "probs_ratio": float(
                masked_mean(ratios_BT.detach(), mask_BT, global_normalization_factor=gvt)
            ),
            "probs_ratio_clamped": float(
                masked_mean(clamped_BT.detach(), mask_BT, global_normalization_factor=gvt)
            ),
            "probs_ratio_min": r_min,
            "probs_ratio_max": r_max,
            "probs_ratio_clamped_min": c_min,
            "probs_ratio_clamped_max": c_max,
        }


def approx_entropy(curr_BT: Tensor, gen_BT: Tensor, mask_BT: Tensor, gvt: Tensor | float) -> float:
    """E_gen[−(π_curr/π_gen) log π_curr]: an entropy estimate from sampled-token logprobs only."""
    with torch.no_grad():
        curr_BT = curr_BT.detach()
        return float(
            -masked_mean(
                torch.exp(curr_BT - gen_BT) * curr_BT, mask_BT, global_normalization_factor=gvt
            )
        )


# ------------------------------------------------------------------------------ loss configs

_DPO_TRAINER_KEYS = frozenset(
    {
        # NeMo-RL hands its whole `dpo:` section to DPOLossFn; these keys belong to the trainer.
        "max_num_epochs",
        "max_num_steps",
        "val_period",
        "val_batches",
        "val_global_batch_size",
        "val_micro_batch_size",
        "val_at_start",
        "val_at_end",
        "seed",
    }
)


def config_mapping(cfg: Any, owner: str) -> Mapping[str, Any]:
    """A loss config as a mapping: None (all defaults), a mapping, an attrs or dataclass
    instance, or a pydantic model (NeMo-RL's ``ClippedPGLossConfig`` and friends)."""
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return cfg  # pyright: ignore[reportUnknownVariableType]
    kind: type[object] = type(cfg)  # pyright: ignore[reportUnknownVariableType] (user object)
    if attrs.has(kind):
        return attrs.asdict(cfg, recurse=False)
    dump = getattr(cfg, "model_dump", None)
    if callable(dump):
        dumped = dump()
        if isinstance(dumped, Mapping):
            return dumped  # pyright: ignore[reportUnknownVariableType]
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    msg = (
        f"{owner} config must be a mapping, an attrs/dataclass instance or a pydantic model "
        f"with its keys, got {type(cfg).__name__}; pass e.g. {owner}({{...}})"
    )
    raise ValueError(msg)


def read_config_mapping(
    cfg: Mapping[str, Any], cls: type[Any], *, section: str, ignored: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Check ``cfg`` against the fields of attrs class ``cls``; every problem in one ConfigError."""
    fields = {f.name: f for f in attrs.fields(cls)}
    problems: list[str] = []
    values: dict[str, Any] = {}
    for key, value in cfg.items():
        if key in ignored:
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.75)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"unknown key {key!r} ({hint}accepted keys: {sorted(fields)}) @ {section}.{key}"
            )
            continue
        kind = fields[key].metadata["kind"]
        if not _has_kind(value, kind):
            problems.append(f"{key} must be {kind}, got {value!r} @ {section}.{key}")
            continue
        values[key] = float(value) if kind.startswith("a number") and value is not None else value
    if problems:
        raise ConfigError("\n".join(problems))
    return values


def _has_kind(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or null")
    if kind.startswith("a bool"):
        return isinstance(value, bool)
    if kind.startswith("a number"):
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)


def _kind(kind: str, default: Any) -> Any:
    return attrs.field(default=default, metadata={"kind": kind})


def _check(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


@attrs.frozen(kw_only=True)
class ClippedPGConfig:
    """NeMo-RL's ``loss_fn`` keys for ClippedPGLossFn, with ``ClippedPGLossConfig``'s defaults.

    ``reference_policy_kl_penalty`` defaults to 0.01 as in NeMo-RL's ``ClippedPGLossConfig``.
    Deliberate differences: ``truncated_importance_sampling_ratio`` set with no type means
    ``"tis"`` (what older NeMo-RL configs, which had no type key, meant); bad values raise
    ``ConfigError`` at construction instead of asserting at the first call; unknown keys are
    errors (NeMo-RL's pydantic model allows extras).
    """

    disable_ppo_ratio: bool = _kind("a bool", False)
    token_level_loss: bool = _kind("a bool", True)
    sequence_level_importance_ratios: bool = _kind("a bool", False)
    ratio_clip_min: float = _kind("a number", 0.2)
    ratio_clip_max: float = _kind("a number", 0.2)
    ratio_clip_c: float | None = _kind("a number or null", None)
    reference_policy_kl_penalty: float = _kind("a number", 0.01)
    reference_policy_kl_type: KLType = _kind("a string", "k3")
    kl_input_clamp_value: float | None = _kind("a number or null", 20.0)
    kl_output_clamp_value: float | None = _kind("a number or null", 10.0)
    use_kl_in_reward: bool = _kind("a bool", False)
    use_importance_sampling_correction: bool = _kind("a bool", False)
    truncated_importance_sampling_type: TruncationType | None = _kind("a string or null", None)
    truncated_importance_sampling_ratio: float | None = _kind("a number or null", None)
    truncated_importance_sampling_ratio_min: float | None = _kind("a number or null", None)
    use_on_policy_kl_approximation: bool = _kind("a bool", False)
    force_on_policy_ratio: bool = _kind("a bool", False)
    use_cispo: bool = _kind("a bool", False)
    positive_example_nll_weight: float = _kind("a number", 0.0)

    @classmethod
    def from_mapping(cls, cfg: Any) -> "ClippedPGConfig":
        """Build from a NeMo-RL ``loss_fn`` mapping or config object (see `config_mapping`);
        missing keys take the defaults."""
        if isinstance(cfg, cls):
            return cfg
        values = read_config_mapping(config_mapping(cfg, "ClippedPGLossFn"), cls, section="loss_fn")
        if values.get("truncated_importance_sampling_ratio") is not None:
            values.setdefault("truncated_importance_sampling_type", "tis")
        return cls(**values)

    def __attrs_post_init__(self) -> None:
        p: list[str] = []
        _check(
            p,
            self.reference_policy_kl_type in ("k1", "k2", "k3"),
            f"reference_policy_kl_type must be 'k1', 'k2' or 'k3', got "
            f"{self.reference_policy_kl_type!r} @ loss_fn.reference_policy_kl_type",
        )
        _check(
            p,
            self.ratio_clip_c is None or self.ratio_clip_c > 1,
            f"ratio_clip_c (dual clip) must be > 1 or null, got {self.ratio_clip_c}; "
            f"3 is the usual value @ loss_fn.ratio_clip_c",
        )
        _check(
            p,
            not (self.sequence_level_importance_ratios and self.token_level_loss),
            "sequence_level_importance_ratios (GSPO) needs a sequence-level loss; set "
            "token_level_loss: false @ loss_fn.sequence_level_importance_ratios",
        )
        _check(
            p,
            self.positive_example_nll_weight >= 0,
            f"positive_example_nll_weight must be >= 0, got {self.positive_example_nll_weight} "
            f"@ loss_fn.positive_example_nll_weight",
        )
        p += self._truncation_problems() + self._cispo_problems()
        if p:
            raise ConfigError("\n".join(p))

    def _truncation_problems(self) -> list[str]:
        kind, hi, lo = (
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        if kind is None:
            return []
        at, p = "@ loss_fn.truncated_importance_sampling_", list[str]()
        _check(
            p,
            kind in ("tis", "icepop", "seq-mask-tis"),
            f"truncated_importance_sampling_type must be 'tis', 'icepop' or 'seq-mask-tis', "
            f"got {kind!r} {at}type",
        )
        _check(
            p,
            self.use_importance_sampling_correction,
            f"truncated importance sampling ({kind}) needs use_importance_sampling_correction: "
            f"true {at}type",
        )
        _check(
            p,
            hi is not None and hi > 0,
            f"truncated_importance_sampling_ratio must be a positive number when a "
            f"truncation type is set, got {hi} {at}ratio",
        )
        _check(
            p,
            lo is None or hi is None or lo <= hi,
            f"truncated_importance_sampling_ratio_min ({lo}) must be <= "
            f"truncated_importance_sampling_ratio ({hi}) {at}ratio_min",
        )
        _check(
            p,
            kind == "tis" or lo is not None,
            f"truncation type {kind!r} needs truncated_importance_sampling_ratio_min {at}ratio_min",
        )
        _check(
            p,
            not (kind == "seq-mask-tis" and self.sequence_level_importance_ratios),
            f"seq-mask-tis uses token-level weights; it cannot be combined with "
            f"sequence_level_importance_ratios: true {at}type",
        )
        return p

    def _cispo_problems(self) -> list[str]:
        if not self.use_cispo:
            return []
        conflicts = {
            "disable_ppo_ratio": self.disable_ppo_ratio,
            "force_on_policy_ratio": self.force_on_policy_ratio,
            "sequence_level_importance_ratios": self.sequence_level_importance_ratios,
            "ratio_clip_c": self.ratio_clip_c is not None,
            "token_level_loss: false": not self.token_level_loss,
        }
        return [
            f"use_cispo cannot be combined with {name}; turn one of them off @ loss_fn.use_cispo"
            for name, active in conflicts.items()
            if active
        ]


@attrs.frozen(kw_only=True)
class DPOConfig:
    """NeMo-RL's DPO loss keys with NeMo-RL's ``DPOLossConfig`` defaults.

    The rest of NeMo-RL's ``dpo:`` section (epochs, validation, seed) is accepted and ignored.
    """

    reference_policy_kl_penalty: float = _kind("a number", 0.05)
    preference_loss_weight: float = _kind("a number", 1.0)
    sft_loss_weight: float = _kind("a number", 0.0)
    preference_average_log_probs: bool = _kind("a bool", False)
    sft_average_log_probs: bool = _kind("a bool", False)

    @classmethod
    def from_mapping(cls, cfg: Any) -> "DPOConfig":
        """Build from a NeMo-RL ``dpo`` mapping or config object; missing keys take the
        defaults."""
        if isinstance(cfg, cls):
            return cfg
        return cls(
            **read_config_mapping(
                config_mapping(cfg, "DPOLossFn"), cls, section="dpo", ignored=_DPO_TRAINER_KEYS
            )
        )

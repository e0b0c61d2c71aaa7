"""The demo's settings and verdict: `DemoOptions` (the CLI flags), `DemoResult` (the curves and
the exit code), the parity tolerance per precision, and the worker config and tiny model a run
builds from them. Nothing here starts a process.
"""

from __future__ import annotations

from typing import Any, Literal

from attrs import field, frozen
from attrs.validators import ge, gt, in_, optional

from policyworker.demo.task import TargetTokenTask
from policyworker.testing import tiny_model_folder

__all__ = [
    "DEFAULT_LR",
    "DEMO_MODEL",
    "DEMO_MODEL_VLLM",
    "ENGINES",
    "LORA_CFG",
    "LORA_FP32_TOLERANCE",
    "PARITY_TOLERANCE",
    "TP_FP32_TOLERANCE",
    "VLLM_FP32_TOLERANCE",
    "DemoOptions",
    "DemoResult",
    "build_tiny_model",
    "demo_config",
    "parity_tolerance",
]

# Largest |trainer logprob - inference logprob| accepted per precision. fp32 must be exact (same
# weights, kernels, shapes, one thread on each side). In bf16/fp16 the trainer runs its fp32
# master weights under autocast while the inference copy holds the cast weights, so the two
# differ at the dtype's rounding noise.
PARITY_TOLERANCE = {"float32": 0.0, "bfloat16": 0.25, "float16": 0.05}
# With LoRA the trainer computes x @ W.T + s * (x @ A.T) @ B.T while the inference copy holds the
# merged W + s * B @ A (what every engine receives): equal in exact arithmetic, not bit for bit.
LORA_FP32_TOLERANCE = 1e-4
# Under tensor parallelism the trainer sums the row-parallel matmul partials across ranks in a
# different order than the single-process inference copy: equal weights, not equal bits.
TP_FP32_TOLERANCE = 1e-5
# vLLM's CPU kernels (its own attention, fused silu-and-mul, rms norm) sum in another order than
# HF's: same weights, not the same bits. Measured max |lp_train - lp_gen| on the tiny models of
# the demo and tests (fp32): 1.4e-6 .. 4.8e-6; a wrong or stale weight gives 1e-2 or more.
VLLM_FP32_TOLERANCE = 1e-4
DEMO_MODEL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# vLLM's CPU attention takes head_dim 64 (not the 16 of DEMO_MODEL): hidden 128 over 2 heads.
DEMO_MODEL_VLLM = {
    **DEMO_MODEL,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
ENGINES = ("hf", "vllm")
# AdamW learning rate per engine when --lr is not given: the vLLM demo's wider model learns the
# toy task about twice as fast, and at 1e-2 its reward passes 0.2 within the first 3 steps
# (measured: 0.01, 0.15, 0.46), which the rise check counts as not having started low.
DEFAULT_LR = {"hf": 1e-2, "vllm": 5e-3}
LORA_CFG = {
    "match_all_linear": False,
    "dim": 8,
    "alpha": 16,
    "target_modules": [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    ],
}


@frozen(kw_only=True)
class DemoOptions:
    """Everything one demo run reads (the CLI flags)."""

    steps: int = field(default=20, validator=ge(1))
    seed: int = field(default=0, validator=ge(0))
    device: Literal["cpu", "cuda", "auto"] = field(
        default="cpu", validator=in_(("cpu", "cuda", "auto"))
    )
    tp: int = field(default=1, validator=ge(1))
    ray: int = field(default=0, validator=ge(0))  # > 0: the policy is a Ray group of N CPU workers
    lora: bool = False
    precision: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", validator=in_(tuple(PARITY_TOLERANCE))
    )
    lr: float | None = field(default=None, validator=optional(gt(0)))  # None: DEFAULT_LR
    kl_penalty: float = field(default=0.01, validator=ge(0))
    require_rise: bool = True
    window: int = field(default=3, validator=ge(1))
    plot: str | None = None
    timeout_s: float = field(default=120.0, validator=gt(0))
    engine: Literal["hf", "vllm"] = field(default="hf", validator=in_(ENGINES))
    inflight: bool = False  # --async: refit while the HF inference process samples
    task: TargetTokenTask = TargetTokenTask()


@frozen(kw_only=True)
class DemoResult:
    """The curves of one run and its verdict (`exit_code` 0 only if both checks passed)."""

    rewards: tuple[float, ...]
    kls: tuple[float, ...]
    refit_ms: tuple[float, ...]
    max_dlogp: tuple[float, ...]
    first: float
    last: float
    rose: bool
    parity_ok: bool
    require_rise: bool
    wall_s: float  # the steps only
    startup_s: float = 0.0  # model, processes and refit connection, before step 1

    @property
    def exit_code(self) -> int:
        if not self.parity_ok:
            return 3
        if self.require_rise and not self.rose:
            return 1
        return 0


def parity_tolerance(precision: str, *, lora: bool, tp_size: int = 1, engine: str = "hf") -> float:
    """Largest accepted max_dlogp: exact in fp32 on one rank without LoRA and with our own HF
    inference process, rounding noise otherwise."""
    tolerance = PARITY_TOLERANCE[precision]
    if engine == "vllm":
        tolerance = max(tolerance, VLLM_FP32_TOLERANCE)
    if tp_size > 1:
        tolerance = max(tolerance, TP_FP32_TOLERANCE)
    return max(tolerance, LORA_FP32_TOLERANCE) if lora else tolerance


def build_tiny_model(
    folder: str, *, vocab_size: int, seed: int, shape: dict[str, Any] | None = None
) -> str:
    """Save a randomly initialised tiny Llama (built from a config, nothing downloaded)."""
    return tiny_model_folder(
        folder,
        "llama",
        vocab=vocab_size,
        seed=seed,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        **(shape or DEMO_MODEL),
    )


def demo_config(model_dir: str, opts: DemoOptions, *, dp_size: int) -> dict[str, Any]:
    """The worker's config mapping (NeMo-RL `policy:` keys): one optimizer step per RL step."""
    n = opts.task.num_rollouts
    if n % dp_size != 0:
        msg = (
            f"{n} rollouts per step do not split over {dp_size} data-parallel ranks; run a "
            f"world size whose dp size divides {n}"
        )
        raise ValueError(msg)
    dtensor: dict[str, Any] = {"tensor_parallel_size": opts.tp}
    if opts.lora:
        dtensor["lora_cfg"] = dict(LORA_CFG)
    return {
        "model_name": model_dir,
        "precision": opts.precision,
        "train_global_batch_size": n,
        "train_micro_batch_size": n // dp_size,
        "logprob_batch_size": n // dp_size,
        "max_grad_norm": 1.0,
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {
                "lr": DEFAULT_LR[opts.engine] if opts.lr is None else opts.lr,
                "weight_decay": 0.0,
            },
        },
        "dtensor_cfg": dtensor,
        "generation": {"temperature": 1.0, "top_p": 1.0},
    }

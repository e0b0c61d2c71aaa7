"""Train a tiny model through `PolicyWorker.train` with NeMo-RL's own loss classes and compare
each with policyworker's loss of the same name on the same batch.

Run by `python -m policyworker._dev.nemo_rl_harness <snapshot> --losses` in a fresh Python
whose `nemo_rl` import hook is installed and whose `nemo_rl.algorithms.loss` is NeMo-RL's,
extracted verbatim. Each loss is built from its NeMo-RL config mapping (through NeMo-RL's own
`*LossConfig` class when the module has one), one fp32 optimizer step is taken from the same
weights with NeMo-RL's loss and with ours, and the loss and grad norm must agree within
`RTOL`/`ATOL`. Prints one line per loss: trained (with both numbers) or failed (and why).
"""

from __future__ import annotations

import importlib
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# (class name, NeMo-RL config class name or None, the loss_fn mapping of a NeMo-RL config)
LOSSES: tuple[tuple[str, str | None, dict[str, Any] | None], ...] = (
    ("NLLLossFn", None, None),
    (
        "ClippedPGLossFn",
        "ClippedPGLossConfig",
        {
            "reference_policy_kl_penalty": 0.01,
            "ratio_clip_min": 0.2,
            "ratio_clip_max": 0.28,
            "ratio_clip_c": None,
            "use_on_policy_kl_approximation": False,
            "use_importance_sampling_correction": False,
            "token_level_loss": True,
        },
    ),
    (
        "DPOLossFn",
        "DPOLossConfig",
        {
            "reference_policy_kl_penalty": 0.05,
            "preference_loss_weight": 1.0,
            "sft_loss_weight": 0.1,
            "preference_average_log_probs": False,
            "sft_average_log_probs": False,
        },
    ),
)
# NeMo-RL's DPO algorithm rolls the reference logprobs left by one before training
# (nemo_rl/algorithms/dpo.py: `torch.roll(logprobs, -1, dims=-1)`) and its DPOLossFn slices them
# `[:, :-1]`; policyworker keeps every per-token tensor in the worker's convention (index 0 = 0,
# sliced `[:, 1:]`). NeMo-RL's loss gets the batch as its algorithm hands it over.
NEMO_RL_ROLLS_REFERENCE = frozenset({"DPOLossFn"})
# Both sides run the same fp32 arithmetic on the same weights and batch.
RTOL = 1e-5
ATOL = 1e-6
_VOCAB = 64
_ROWS = 4
_WIDTH = 10


def batch() -> dict[str, torch.Tensor]:
    """4 right-padded rows (pairs (0, 1) and (2, 3) are DPO's chosen/rejected) with every key
    the three losses read."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([10, 7, 9, 6])
    valid = torch.arange(_WIDTH)[None] < lengths[:, None]
    ids = torch.where(valid, torch.randint(3, _VOCAB, (_ROWS, _WIDTH), generator=gen), 0)
    token_mask = valid.float()
    token_mask[:, :3] = 0  # the prompt
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(_ROWS),
        "advantages": torch.randn(_ROWS, _WIDTH, generator=gen),
        "prev_logprobs": -torch.rand(_ROWS, _WIDTH, generator=gen) * 3,
        "generation_logprobs": -torch.rand(_ROWS, _WIDTH, generator=gen) * 3,
        "reference_policy_logprobs": -torch.rand(_ROWS, _WIDTH, generator=gen) * 3,
    }


def worker_config(model_path: str) -> dict[str, Any]:
    """fp32, one global batch of 4 rows in microbatches of 2 (each holds one DPO pair)."""
    return {
        "model_name": model_path,
        "precision": "float32",
        "train_global_batch_size": _ROWS,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.0}},
    }


def nemo_rl_batch(name: str) -> dict[str, torch.Tensor]:
    """`batch()` as NeMo-RL's algorithm gives it to its loss `name`."""
    data = batch()
    if name in NEMO_RL_ROLLS_REFERENCE:
        data["reference_policy_logprobs"] = torch.roll(
            data["reference_policy_logprobs"], -1, dims=-1
        )
    return data


def one_step(model_path: str, loss_fn: Any, data: dict[str, Any]) -> tuple[float, float]:
    """(loss, grad norm) of one `PolicyWorker.train` step on `data` from the saved weights."""
    from policyworker.shell.worker.policy_worker import PolicyWorker

    worker = PolicyWorker(worker_config(model_path))
    try:
        result = worker.train(data, loss_fn)
    finally:
        worker.shutdown()
    if result["skipped_steps"]:
        msg = f"the optimizer step was skipped (skipped_steps={result['skipped_steps']})"
        raise RuntimeError(msg)
    return float(result["global_loss"][0]), float(result["grad_norm"])


def build(module: Any, name: str, cfg_name: str | None, cfg: dict[str, Any] | None) -> Any:
    """`name(cfg)` as NeMo-RL builds it: the mapping through `cfg_name` when `module` has it."""
    cls = getattr(module, name)
    if cfg is None:
        return cls()
    cfg_cls = getattr(module, cfg_name, None) if cfg_name else None
    return cls(cfg_cls(**cfg) if cfg_cls is not None else dict(cfg))


def compare(name: str, theirs: Callable[[], Any], ours: Callable[[], Any], model_path: str) -> str:
    """One line: `<name>: trained (...)` when NeMo-RL's loss trains and agrees with ours."""
    try:
        their_loss, their_norm = one_step(model_path, theirs(), nemo_rl_batch(name))
    except Exception as error:  # the report names whatever stopped it
        return f"{name}: failed ({type(error).__name__}: {_first_line(error)})"
    our_loss, our_norm = one_step(model_path, ours(), batch())
    numbers = (
        f"loss {their_loss:.6f} vs ours {our_loss:.6f} (|diff| {abs(their_loss - our_loss):.1e}), "
        f"grad_norm {their_norm:.6f} vs ours {our_norm:.6f} "
        f"(|diff| {abs(their_norm - our_norm):.1e})"
    )
    agree = all(
        math.isfinite(a) and math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)
        for a, b in ((their_loss, our_loss), (their_norm, our_norm))
    )
    if not agree:
        return f"{name}: failed (differs from ours beyond rtol {RTOL}, atol {ATOL}: {numbers})"
    return f"{name}: trained ({numbers}; rtol {RTOL}, atol {ATOL})"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def main() -> int:
    from policyworker.nemo_rl import loss as faces
    from policyworker.testing import tiny_model_folder

    try:
        theirs = importlib.import_module("nemo_rl.algorithms.loss.loss_functions")
    except Exception as error:
        for name, _, _ in LOSSES:
            print(f"{name}: failed (importing NeMo-RL's loss_functions: {_first_line(error)})")
        return 0
    with tempfile.TemporaryDirectory(prefix="nemo_rl_losses_") as folder:
        model_path = tiny_model_folder(
            Path(folder) / "llama", "llama", vocab=_VOCAB, init_std=0.2, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        for name, cfg_name, cfg in LOSSES:
            if not hasattr(theirs, name):
                print(f"{name}: failed (NeMo-RL's loss_functions has no {name})")
                continue
            line = compare(
                name,
                lambda n=name, c=cfg_name, m=cfg: build(theirs, n, c, m),
                lambda n=name, m=cfg: build(faces, n, None, m),
                model_path,
            )
            print(line, flush=True)
    return 0

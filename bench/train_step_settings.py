"""What a train-step run is set to: its MFU target, each optimizer's bench settings, and
torch._inductor options from the command line. See `bench.train_step`."""

from __future__ import annotations

import argparse
import json

from bench.common import device

__all__ = ["mfu_target", "optimizer_section", "set_inductor_options"]

# MFU targets with the default config, per `--shape`: the 1.5B shape trained in full, and an
# 8B-class shape on one GPU with LoRA; the 7B shape trained in full on one GPU (a factored
# optimizer state) has its own.
MFU_TARGETS = {"1.5b": 0.50, "7b": 0.45}
MFU_TARGET_7B_FULL = 0.35
# The bench's optimizer settings per class; the learning rates only keep a random model's steps
# small (Adafactor's is relative to each weight's RMS: 5e-5 of a weight of RMS 0.02 is AdamW's
# 1e-6). `fused` is set on CUDA where the class takes it.
OPTIMIZER_KWARGS: dict[str, dict] = {
    "torch.optim.AdamW": {"lr": 1e-6, "weight_decay": 0.01},
    "torch.optim.Adafactor": {"lr": 5e-5, "weight_decay": 0.01},
}
_FUSED = ("torch.optim.AdamW", "torch.optim.Adam")


def mfu_target(args: argparse.Namespace) -> float | None:
    """The run's MFU target, or None: a 1.5B LoRA run has none (its target is speed against
    full fine-tuning, `--also-lora-dim`'s row)."""
    if args.shape == "1.5b" and args.lora_dim:
        return None
    if args.shape == "7b" and not args.lora_dim:
        return MFU_TARGET_7B_FULL
    return MFU_TARGETS[args.shape]


def optimizer_section(name: str, args: argparse.Namespace) -> dict:
    """`policy.optimizer` for `name`: `OPTIMIZER_KWARGS` (lr 1e-6 for a class it lacks), fused
    on CUDA where the class has a fused kernel, then `--optimizer-kwargs`."""
    kwargs = dict(OPTIMIZER_KWARGS.get(name, {"lr": 1e-6}))
    if name in _FUSED:
        kwargs["fused"] = device().type == "cuda"
    kwargs.update(json.loads(args.optimizer_kwargs or "{}"))
    return {"name": name, "kwargs": kwargs}


def set_inductor_options(settings: list[str]) -> None:
    """Apply `--inductor KEY=VALUE` settings to torch._inductor.config; an unknown key fails."""
    import ast

    import torch._inductor.config as inductor_config

    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not hasattr(inductor_config, key):
            msg = f"--inductor {setting!r}: expected KEY=VALUE with KEY in torch._inductor.config"
            raise SystemExit(msg)
        setattr(inductor_config, key, ast.literal_eval(value))
        print(f"torch._inductor.config.{key} = {getattr(inductor_config, key)!r}")

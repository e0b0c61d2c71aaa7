"""Offload: moving the model, its buffers and the optimizer state between the device and the CPU.

Under FSDP2 CPU offload (`dtensor_cfg.cpu_offload`) the parameters live on the CPU for good and
FSDP2 streams them; only the buffers move then, and the optimizer stays with its CPU params.

A co-trained draft (`policy.draft`: a plain module, never FSDP2-offloaded) and its optimizer
state follow the policy through every step below: wherever the policy or its optimizer state
goes to the CPU or back to the device, the draft's goes too.
"""

from __future__ import annotations

import logging

import torch

from policyworker.shell.model.hf_model import set_training_mode
from policyworker.shell.parallel import plans as parallel_lib
from policyworker.shell.worker.state import WorkerState

__all__ = [
    "finish_inference",
    "move_buffers",
    "move_model",
    "move_optimizer",
    "offload_after_refit",
    "offload_before_refit",
    "prepare_for_lp_inference",
    "prepare_for_training",
]

log = logging.getLogger(__name__)


def move_buffers(
    state: WorkerState, model: torch.nn.Module, device: str | torch.device
) -> torch.nn.Module:
    """Move `model`'s buffers (not its parameters) to `device`."""
    parallel_lib.move_buffers(model, state.resolve_device(device))
    return model


def move_model(
    state: WorkerState, model: torch.nn.Module, device: str | torch.device
) -> torch.nn.Module:
    """Move `model`'s buffers and parameters to `device`."""
    device = state.resolve_device(device)
    move_buffers(state, model, device)
    return model.to(device)


def move_optimizer(state: WorkerState, device: str | torch.device) -> None:
    """Move every state tensor of the policy's and the draft's optimizers to `device` (nothing
    without an optimizer)."""
    device = state.resolve_device(device)
    for optimizer in (state.optimizer, state.draft.optimizer):
        if optimizer is not None:
            _move_optimizer_state(optimizer, device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for group in optimizer.param_groups:
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor) or value.device == device:
                    continue
                if _host_step(key, value, step_on_device) and device.type != "cpu":
                    continue
                optimizer.state[param][key] = value.to(device)


def _host_step(key: str, value: torch.Tensor, step_on_device: bool) -> bool:
    """Torch keeps a non-fused, non-capturable optimizer's step counter on the host: on the
    device, the bias correction would read it back once per parameter and step."""
    return key == "step" and value.dim() == 0 and not step_on_device


def _move_draft(state: WorkerState, device: str | torch.device) -> None:
    """The draft model (parameters and buffers) to `device`; nothing without a draft."""
    if state.draft.model is not None:
        move_model(state, state.draft.model, device)


def to_device(state: WorkerState, model: torch.nn.Module) -> torch.nn.Module:
    """`model` onto the worker's device, then return cached blocks."""
    model = move_model(state, model, state.device)
    state.empty_cache()
    return model


def to_cpu(state: WorkerState, model: torch.nn.Module) -> torch.nn.Module:
    """`model` onto the CPU, then collect garbage and return cached blocks."""
    model = move_model(state, model, "cpu")
    state.release_memory()
    return model


def _fsdp_offloaded(state: WorkerState) -> bool:
    """FSDP2 CPU offload: parameters live on the CPU for good and FSDP2 streams them."""
    return state.cfg.dtensor_cfg.cpu_offload and state.parallel.mesh is not None


def prepare_for_training(state: WorkerState) -> None:
    """Model (and optimizer state) onto the device, train mode."""
    if _fsdp_offloaded(state):  # buffers only; the optimizer stays with its CPU params
        move_buffers(state, state.model, state.device)
        if state.draft.optimizer is not None:
            _move_optimizer_state(state.draft.optimizer, state.device)
    else:
        to_device(state, state.model)
        move_optimizer(state, state.device)
    _move_draft(state, state.device)
    set_training_mode(state.model, True)
    state.empty_cache()


def prepare_for_lp_inference(state: WorkerState, keep_train_buffers: bool) -> None:
    """Model onto the device, eval mode; optimizer state to the CPU when the config says so."""
    if _fsdp_offloaded(state):
        move_buffers(state, state.model, state.device)
    else:
        to_device(state, state.model)
    set_training_mode(state.model, False)
    if (
        not keep_train_buffers
        and state.optimizer is not None
        and (state.cfg.offload_optimizer_for_logprob)
    ):
        move_optimizer(state, "cpu")
    state.release_memory()


def finish_inference(state: WorkerState) -> None:
    """Model (and draft) to the CPU, eval mode."""
    _move_draft(state, "cpu")
    to_cpu(state, state.model)
    set_training_mode(state.model, False)


def offload_before_refit(state: WorkerState) -> None:
    """Optimizer state (the policy's and the draft's) to the CPU (the weights stay: the refit
    reads them)."""
    move_optimizer(state, "cpu")
    state.release_memory()


def offload_after_refit(state: WorkerState) -> None:
    """Model, draft and optimizer state to the CPU, leaving the device to the inference
    engine."""
    _move_draft(state, "cpu")
    to_cpu(state, state.model)
    set_training_mode(state.model, False)
    offload_before_refit(state)
    if state.device.type == "cuda":
        log.info(
            "after offload_after_refit: %.3f GiB allocated, %.3f GiB reserved",
            torch.cuda.memory_allocated() / 2**30,
            torch.cuda.memory_reserved() / 2**30,
        )

"""NeMo-RL's offload calls of `PolicyWorker` (a mixin): the model, its buffers and the
optimizer state between the device and the CPU, around training, logprobs and refits.

Each method is one call into `offload.py` with the worker's `WorkerState`.
"""

from __future__ import annotations

from typing import Any

import torch

import policyworker.shell.worker.offload as offload
from policyworker.shell.worker.state import WorkerState

__all__ = ["OffloadCalls"]


class OffloadCalls:
    """Offload and placement calls; the class using it holds `state`."""

    state: WorkerState

    def move_buffer_to_device(
        self, model: torch.nn.Module, device: str | torch.device
    ) -> torch.nn.Module:
        """Move `model`'s buffers (not its parameters) to `device`; returns `model`."""
        return offload.move_buffers(self.state, model, device)

    def move_to_device(self, model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
        """Move `model`'s buffers and parameters to `device` ("cuda" without CUDA: the CPU)."""
        return offload.move_model(self.state, model, device)

    def move_to_cuda(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move `model` to the worker's device and return cached accelerator blocks."""
        return offload.to_device(self.state, model)

    def move_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move `model` to the CPU and return cached accelerator blocks."""
        return offload.to_cpu(self.state, model)

    def move_optimizer_to_device(self, device: str | torch.device) -> None:
        """Move the optimizer state tensors to `device` (nothing without an optimizer)."""
        offload.move_optimizer(self.state, device)

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Model and optimizer state onto the device, train mode (NeMo-RL passes arguments its
        drivers share with other backends; none changes what this does)."""
        offload.prepare_for_training(self.state)

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Model onto the device, eval mode; the optimizer state goes to the CPU when
        `offload_optimizer_for_logprob` is set and `keep_train_buffers` is False."""
        offload.prepare_for_lp_inference(self.state, keep_train_buffers)

    def finish_inference(self) -> None:
        """Model to the CPU, eval mode."""
        offload.finish_inference(self.state)

    def finish_training(self) -> None:
        """Nothing to release (grads are freed at the end of every train() call)."""

    def offload_before_refit(self) -> None:
        """Optimizer state to the CPU before a refit (the weights stay: the refit reads them)."""
        offload.offload_before_refit(self.state)

    def offload_after_refit(self) -> None:
        """Model and optimizer state to the CPU after a refit, freeing the device."""
        offload.offload_after_refit(self.state)

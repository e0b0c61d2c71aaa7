"""`TrainingClient`: Tinker's training-client calls over one `PolicyWorker` (or one adapter of
it), and sampling through an attached engine (`HFSampler`).

The worker's `train` runs forward, backward and the optimizer step as one call, so
`forward_backward` computes the loss and logprobs now and keeps the data; `optim_step` runs the
backward of everything kept since the last step and the step itself, as one global batch. The
gradient is the one Tinker's pair of calls gives (the weights do not move in between); the cost
is one extra forward. docs/training-client.md lists every difference from Tinker.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from policyworker.shell.model.peft_adapter import save_peft_adapter
from policyworker.training_client.datums import loss_for, rl_inputs_missing, to_batch
from policyworker.training_client.types import (
    AdamParams,
    Datum,
    Done,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsResponse,
)

__all__ = ["SamplingClient", "TrainingClient"]


@attrs.define
class _Pending:
    """Data whose backward waits for the next `optim_step`, and the loss it runs under."""

    data: list[Datum]
    loss: Any
    loss_key: tuple[Any, ...]


class TrainingClient:
    """Tinker's `TrainingClient` calls on `worker` (a LoRA `PolicyWorker`; `adapter` names one
    of its `lora_cfg.adapters`, so several clients can train adapters of one base). Every call
    runs before it returns; its `Done` answers `result()` at once. Folders go under `root`."""

    def __init__(
        self,
        worker: Any,
        *,
        adapter: str | None = None,
        sampler: Any = None,
        root: str | pathlib.Path = ".",
    ) -> None:
        if not worker.lora_module_names:
            msg = (
                "TrainingClient needs a LoRA worker (policy.dtensor_cfg.lora_cfg set): the "
                "sampler weights are a PEFT adapter folder"
            )
            raise ValueError(msg)
        if adapter is not None:
            worker.select_adapter(adapter)  # refuses an unknown name
        self.worker, self.adapter, self.sampler = worker, adapter, sampler
        self.root = pathlib.Path(root)
        self._pending: _Pending | None = None

    # ------------------------------------------------------------------------------ training

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: Any = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> Done[ForwardBackwardOutput]:
        """Loss and per-datum target logprobs under the current weights; no gradient."""
        loss = self._loss(data, loss_fn, loss_fn_config)
        return Done(self._forward(data, loss))

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: Any,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> Done[ForwardBackwardOutput]:
        """`forward`, and `data` joins the next `optim_step`'s gradient."""
        loss = self._loss(data, loss_fn, loss_fn_config)
        key = (
            loss_fn if isinstance(loss_fn, str) else id(loss_fn),
            tuple(sorted((loss_fn_config or {}).items())),
        )
        if self._pending is not None and self._pending.loss_key != key:
            msg = (
                f"forward_backward: loss_fn {loss_fn!r} differs from the one of the data "
                "waiting for optim_step; call optim_step first (one step runs one loss)"
            )
            raise ValueError(msg)
        out = self._forward(data, loss)
        if self._pending is None:
            self._pending = _Pending(data=[], loss=loss, loss_key=key)
        self._pending.data.extend(data)
        return Done(out)

    def optim_step(self, adam_params: AdamParams) -> Done[OptimStepResponse]:
        """One Adam step with `adam_params` over the gradient of every `forward_backward` since
        the last step."""
        opt = self.worker.optimizer
        if self._pending is None:
            msg = "optim_step: no forward_backward since the last step; nothing to step on"
            raise ValueError(msg)
        if opt is None or any("betas" not in g or "eps" not in g for g in opt.param_groups):
            msg = (
                "optim_step sets Adam hyperparameters; build the worker with an Adam-family "
                "optimizer (policy.optimizer.name: torch.optim.AdamW)"
            )
            raise ValueError(msg)
        pending, self._pending = self._pending, None
        self._select()  # the adapter's own lr comes in with it; then ours overrides it
        for group in opt.param_groups:
            group.update(
                lr=adam_params.learning_rate,
                betas=(adam_params.beta1, adam_params.beta2),
                eps=adam_params.eps,
                weight_decay=adam_params.weight_decay,
            )
        batch = to_batch(pending.data)
        rows = len(pending.data)
        result = self.worker.train(batch, pending.loss, gbs=rows, adapter=self.adapter)
        metrics = {
            "loss:mean": float(result["global_loss"].sum()),
            "grad_norm": float(result["grad_norm"] or 0.0),
            "skipped_steps": float(result["skipped_steps"]),
        }
        return Done(OptimStepResponse(metrics=metrics))

    # ------------------------------------------------------------------------------ weights

    def save_weights_for_sampler(self, name: str) -> Done[SaveWeightsResponse]:
        """The adapter as a PEFT folder ``<root>/sampler_weights/<name>``, loaded into the
        attached sampler when there is one."""
        folder = self._folder("sampler_weights", name)
        self._select()
        cfg = self.worker.cfg
        save_peft_adapter(
            self.worker.model,
            folder,
            lora_cfg=cfg.dtensor_cfg.lora_cfg,
            base_model_name_or_path=cfg.model_name,
            write=self.worker.parallel.rank == 0,
        )
        if self.sampler is not None:
            self.sampler.load_adapter(folder)
        return Done(SaveWeightsResponse(path=str(folder)))

    def save_state(self, name: str) -> Done[SaveWeightsResponse]:
        """Weights and optimizer state under ``<root>/state/<name>`` (a worker checkpoint)."""
        folder = self._folder("state", name)
        self._select()
        self.worker.save_checkpoint(
            str(folder / "weights"), str(folder / "optimizer"), is_final_checkpoint=True
        )
        return Done(SaveWeightsResponse(path=str(folder)))

    def load_state(self, path: str | pathlib.Path) -> Done[None]:
        """Weights and optimizer state from a `save_state` folder; data waiting for
        `optim_step` is dropped (its logprobs were of the old weights)."""
        folder = pathlib.Path(path)
        self._select()
        self.worker.load_checkpoint(str(folder / "weights"), str(folder / "optimizer"))
        self._pending = None
        return Done(None)

    def save_weights_and_get_sampling_client(self, name: str) -> SamplingClient:
        """`save_weights_for_sampler(name)`, then a `SamplingClient` over the sampler."""
        if self.sampler is None:
            msg = "a sampling client needs a sampler: TrainingClient(worker, sampler=HFSampler())"
            raise ValueError(msg)
        self.save_weights_for_sampler(name)
        return SamplingClient(self.sampler)

    # ------------------------------------------------------------------------------ sampling

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
    ) -> Done[SampleResponse]:
        """`num_samples` continuations of `prompt` from the attached sampler (the weights of the
        last `save_weights_for_sampler`)."""
        if self.sampler is None:
            msg = "sample() needs a sampler: TrainingClient(worker, sampler=HFSampler(model_path))"
            raise ValueError(msg)
        return Done(self.sampler.sample(prompt, num_samples, sampling_params or SamplingParams()))

    def get_tokenizer(self) -> Any:
        """The worker's tokenizer (None when its model folder has no tokenizer files)."""
        return self.worker.tokenizer

    # ------------------------------------------------------------------------------ helpers

    def _select(self) -> None:
        if self.adapter is not None:
            self.worker.select_adapter(self.adapter)

    def _folder(self, kind: str, name: str) -> pathlib.Path:
        if not name or "/" in name or name in (".", ".."):
            msg = f"name {name!r} must be a plain folder name (no '/'), e.g. 'step-3'"
            raise ValueError(msg)
        return self.root / kind / name

    def _loss(self, data: Sequence[Datum], loss_fn: Any, config: Any) -> Any:
        loss = loss_for(loss_fn, config)
        if not data:
            msg = "data is empty; pass at least one Datum"
            raise ValueError(msg)
        missing = rl_inputs_missing(data)
        if isinstance(loss_fn, str) and loss_fn != "cross_entropy" and missing:
            msg = f"loss_fn {loss_fn!r} needs loss_fn_inputs {missing} in every datum"
            raise ValueError(msg)
        return loss

    def _forward(self, data: Sequence[Datum], loss: Any) -> ForwardBackwardOutput:
        batch = to_batch(data)
        rows = len(data)
        result = self.worker.train(batch, loss, eval_mode=True, gbs=rows, adapter=self.adapter)
        lp = self.worker.get_logprobs(batch, adapter=self.adapter)["logprobs"]
        lengths = batch["input_lengths"]
        outputs = [{"logprobs": lp[b, 1 : int(lengths[b])].clone()} for b in range(rows)]
        metrics = {"loss:mean": float(result["global_loss"].sum())}
        for key, values in result["all_mb_metrics"].items():
            numbers = [float(v) for v in values if isinstance(v, (int, float, torch.Tensor))]
            if numbers and key != "loss":
                metrics[key] = sum(numbers) / len(numbers)
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)


class SamplingClient:
    """Tinker's `SamplingClient.sample` over a sampler (the weights it was last given)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
    ) -> Done[SampleResponse]:
        """`num_samples` continuations of `prompt` from the sampler's current weights."""
        return Done(self.sampler.sample(prompt, num_samples, sampling_params or SamplingParams()))

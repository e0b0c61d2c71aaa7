"""PolicyWorker: the facade with NeMo-RL's policy-worker surface, one short method per call.

Every method is collective (all ranks of the process group call it together) and reads the
same way: check the arguments, then one call into the room that does the work, with the
worker's resources (`self.state`, a `WorkerState`) as its first argument:

    training.py     train: global batches, microbatches, the loss, the optimizer step
    inference.py    logprobs, reference logprobs, top-k logits, scores, full logits over IPC
    calibration.py  FP8 scales of the attention projections
    offload.py      model, buffers and optimizer state between the device and the CPU
                    (the calls: offload_calls.py, a mixin)
    refit_calls.py  refit over ZMQ / a collective / SGLang, and weight noise
    checkpoint/     save / load / finalize

Parallel layout: with a process group (the default one, or one the worker creates under
torchrun), the state applies tensor
parallelism (tp > 1, vocab-parallel lm_head) and FSDP2 over dp (`shell.parallel`). Logprobs and
top-k then read vocab-sharded DTensor logits through `shell.parallel.collectives` (no vocab
gather), the grad norm is sharding-aware, and FSDP2 roots are resharded after every no-grad pass
and before any state read. Weight refits gather on every rank; only rank 0 sends over ZMQ.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

import policyworker.shell.checkpoint as checkpoint
import policyworker.shell.worker.adapters as adapters
import policyworker.shell.worker.calibration as calibration
import policyworker.shell.worker.data_plane_calls as data_plane_calls
import policyworker.shell.worker.inference as inference
import policyworker.shell.worker.memory_calls as memory_calls
import policyworker.shell.worker.microbatches as mbatch
import policyworker.shell.worker.refit_calls as refit_calls
import policyworker.shell.worker.training as training
from policyworker.config import PolicyConfig, load_config
from policyworker.data import BatchedDataDict
from policyworker.errors import ConfigError
from policyworker.shell.logs import apply_env_verbosity, quiet_progress_bars, startup_summary
from policyworker.shell.model import hf_model as model_lib
from policyworker.shell.parallel.agreed_checks import agreed_checks
from policyworker.shell.worker.checkpoint_engine_calls import CheckpointEngineCalls
from policyworker.shell.worker.nemo_rl_surface import NeMoRLWorkerSurface, split_constructor_kwargs
from policyworker.shell.worker.offload_calls import OffloadCalls
from policyworker.shell.worker.split_step import SplitStepCalls
from policyworker.shell.worker.state import WorkerState

__all__ = ["AutomodelPolicyWorker", "AutomodelPolicyWorkerImpl", "PolicyWorker"]

log = logging.getLogger(__name__)


def _state_field(name: str, doc: str) -> property:
    """A worker attribute that reads and writes the field `name` of `worker.state`."""
    return property(
        lambda self: getattr(self.state, name),
        lambda self, value: setattr(self.state, name, value),
        doc=doc,
    )


class PolicyWorker(
    data_plane_calls.DataPlaneCalls,
    SplitStepCalls,
    OffloadCalls,
    NeMoRLWorkerSurface,
    CheckpointEngineCalls,
):
    """Trains a Hugging Face model with a pluggable loss; logprobs, top-k, scores, offload,
    refit and checkpoints (NeMo-RL's policy-worker method names); NeMo-RL's base-worker methods
    via the mixin."""

    cfg = _state_field("cfg", "The PolicyConfig the worker was built from.")
    parallel = _state_field("parallel", "This rank's ParallelContext (dp, cp, tp).")
    device = _state_field("device", "The device the model trains on (CPU without CUDA).")
    dtype = _state_field("dtype", "The compute dtype of `precision`.")
    model = _state_field("model", "The Hugging Face model (FSDP2/TP-wrapped in a group).")
    tokenizer = _state_field("tokenizer", "The tokenizer, or None without tokenizer files.")
    optimizer = _state_field("optimizer", "The optimizer, or None (init_optimizer=False).")
    scheduler = _state_field("scheduler", "The LR scheduler, or None without an optimizer.")
    lora_module_names = _state_field("lora_module_names", "Modules that carry LoRA adapters.")
    fusion_report = _state_field("fusion_report", "What `dtensor_cfg.fusion` compiled.")
    float8_report = _state_field("float8_report", "What `dtensor_cfg.fp8` converted.")
    _reference_state = _state_field("reference_state", "CPU reference weights, or None.")

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        **kwargs: Any,
    ) -> None:
        """Load the model of `config` (a PolicyConfig or NeMo-RL `policy:` mapping), shard it
        over the process group, build optimizer and reference weights, and load a checkpoint
        from `weights_path` / `optimizer_path` when given. `parallel=` injects a context; the
        keyword arguments NeMo-RL's Policy passes are accepted (`nemo_rl_surface`)."""
        apply_env_verbosity()
        if isinstance(config, (str, os.PathLike)):  # a model folder or id where a config goes
            msg = (
                f"PolicyWorker(config={str(config)!r}): config is a policy mapping or a "
                f"PolicyConfig, not a model; pass PolicyWorker({{'model_name': {str(config)!r}}}) "
                f"(plus any other policy keys)"
            )
            raise ConfigError(msg)
        cfg = config if isinstance(config, PolicyConfig) else load_config(config)
        cfg = memory_calls.preflight(cfg)  # auto-tune, and refuse what cannot fit, before loading
        parallel, tokenizer = split_constructor_kwargs(kwargs)
        with quiet_progress_bars():  # transformers' "Loading weights" bars
            self.state = WorkerState.build(
                cfg,
                parallel=parallel,
                weights_path=weights_path,
                optimizer_path=optimizer_path,
                init_optimizer=init_optimizer,
                init_reference_model=init_reference_model,
            )
        if tokenizer is not None:
            self.state.tokenizer = tokenizer
        if self.parallel.rank == 0:
            log.info("%s", startup_summary(self.state, name=type(self).__name__))

    def plan_memory(self) -> dict[str, dict[str, Any]]:
        """Predicted peak device bytes per phase (train step, optimizer step, logprobs,
        reference, top-k, refit, checkpoint): each phase's terms, total, budget and whether it
        fits (docs/memory.md)."""
        return memory_calls.plan_for_state(self.state)

    @property
    def policy_version(self) -> int:
        """Optimizer steps applied since the worker was built: the version per-token
        ``generation_versions`` are measured against (see `functional.staleness`)."""
        return self.state.policy_version

    @property
    def _sampling(self) -> tuple[float, int | None, float]:
        """(temperature, top_k, top_p) logprobs are computed under right now."""
        return attrs.astuple(self.state.sampling)

    # ------------------------------------------------------------------------------ train

    def train(
        self,
        data: Mapping[str, Any],
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        check_dim_skip_keys: Any = None,
        *,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """Train on every whole global batch of `data` (one optimizer step per global batch).

        Returns `global_loss` [num global batches], `grad_norm`, `all_mb_metrics`,
        `metric_reductions` (how each metric reduces across microbatches, from the loss's
        `metric_normalizations`; {} for a loss without them), `rank`,
        `model_dtype`, `skipped_steps` (steps skipped for a non-finite loss or grad norm),
        `step_time_s` (wall seconds of the call), `tokens_per_s` (this rank's tokens, the
        `input_lengths` of the rows trained, per second) and `peak_memory_bytes` (on CUDA
        `torch.cuda.max_memory_allocated` during the call; on the CPU the process's peak RSS).

        The batch is checked once, before any work (docs/batch-format.md; the loss contract:
        docs/custom-loss.md). If the call raises after some global batches stepped (a loss that
        raises in global batch 2), their optimizer steps are kept and the LR scheduler steps as
        after a successful call (once per call that applied a step, as NeMo-RL's worker);
        the gradients are freed either way. ``adapter`` (a `lora_cfg.adapters` name) trains
        that adapter with its own optimizer state; it stays the active one.
        """
        skip = tuple(check_dim_skip_keys or ())
        with agreed_checks(self.state.parallel, what="train"):  # all ranks refuse, or none
            adapters.check_name(self.state, adapter)
            batch = training.check_train_call(
                self.state, data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs, skip=skip
            )
        adapters.select(self.state, adapter)
        return training.train(self.state, batch, loss_fn, eval_mode=eval_mode, skip=skip)

    # ------------------------------------------------------------------------------ inference

    def get_logprobs(
        self,
        data: Mapping[str, Any],
        micro_batch_size: int | None = None,
        require_router_replay: bool = True,
        *,
        entropy: bool = False,
        top_k: int | None = None,
        adapter: str | None = None,
    ) -> BatchedDataDict:
        """fp32 [B, S] logprobs: 0 at column 0 and at positions >= input_lengths.

        From the same forward pass and LM-head chunks, no [B, S, V] fp32 logits made:
        ``entropy=True`` adds fp32 [B, S] ``"entropy"``, the entropy (nats) of each next-token
        distribution ``softmax(logits / temperature)`` on the logprobs' positions (0 where they
        are 0; sampling's top-k/top-p do not apply); ``top_k=k`` adds ``"topk_logits"`` /
        ``"topk_indices"`` [B, S, k], equal to ``get_topk_logits(data, k)``. ``adapter``: as
        in `train` (it becomes the active adapter).
        """
        inference.check_extra_scores(entropy, top_k)
        with agreed_checks(self.state.parallel, what="get_logprobs"):  # all refuse, or none
            adapters.check_name(self.state, adapter)
            data = mbatch.validate(self.state, data)
            self.state.moe.check_replay_data(data, require=require_router_replay)
        adapters.select(self.state, adapter)
        return inference.logprobs(
            self.state,
            data,
            micro_batch_size,
            replay_routes=require_router_replay,
            entropy=entropy,
            top_k=top_k or 0,
        )

    def get_reference_policy_logprobs(
        self, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """Logprobs of the reference weights (filters off, temperature kept)."""
        with self.use_reference_model():
            out = self.get_logprobs(data, micro_batch_size, require_router_replay=False)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Swap the reference weights in place (or, with `lora_cfg.reference: base`, switch the
        adapters off); restore the policy weights even on error."""
        base = adapters.base_is_reference(self.state)
        with (adapters.base_reference if base else inference.reference_model)(self.state):
            yield

    def select_adapter(self, adapter: str) -> None:
        """Make `adapter` (a `lora_cfg.adapters` name) the model's adapter: the one refits,
        `save_checkpoint` and calls without ``adapter=`` use."""
        adapters.check_name(self.state, adapter)
        adapters.select(self.state, adapter)

    def get_topk_logits(
        self, data: Mapping[str, Any], k: int, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """Top-k of temperature-scaled logits at every position (no shift), 0/0 at padding."""
        data = mbatch.validate(self.state, data)
        inference.check_k("k", k)
        return inference.topk_logits(self.state, data, k, micro_batch_size)

    def score(self, data: Mapping[str, Any]) -> BatchedDataDict:
        """Reward scores: [B] (bradley_terry, at the last token) or [B, S] (regression)."""
        kind = model_lib.reward_model_type(self.cfg)
        if kind is None:
            msg = "score() needs a reward model; set reward_model_cfg in the config"
            raise ValueError(msg)
        data = mbatch.validate(self.state, data)
        return inference.scores(self.state, data, kind)

    def calibrate_qkv_fp8_scales(
        self,
        data: Mapping[str, Any],
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        """Per-attention-layer FP8 (e4m3) scales: percentile(|k|, |v|[, |q|]) * margin / 448."""
        data = mbatch.validate(self.state, data)
        if not 0.0 < percentile <= 100.0 or margin <= 0:
            msg = f"percentile={percentile} must be in (0, 100] and margin={margin} > 0"
            raise ValueError(msg)
        return calibration.calibrate_qkv_fp8_scales(
            self.state,
            data,
            micro_batch_size,
            percentile=percentile,
            margin=margin,
            include_q=include_q,
        )

    def get_full_logits_ipc(
        self, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> dict[str, Any]:
        """fp32 logits of every sample into a shared buffer: one handle record per input row
        (`per_sample_handles`) and this rank's `dp_rank` (docs/refit-collective.md, "Teacher
        logits over IPC")."""
        return inference.full_logits_ipc(self.state, data, micro_batch_size)

    def release_ipc_buffer(self) -> None:
        """Drop the shared logits storage (handles returned earlier stop being valid)."""
        inference.release_ipc_buffer(self.state)

    # ------------------------------------------------------------------------------ refit

    def prepare_refit_info(
        self, *, adapter_only: bool = False
    ) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """{hf_name: (shape, dtype)} in send order (the dtypes every refit sends); global
        (unsharded) shapes on every rank. ``adapter_only``: those of an adapter-only refit."""
        return refit_calls.refit_info(self.state, adapter_only=adapter_only)

    def get_zmq_address(self) -> str:
        """The address rank 0's receiver connects to (every rank has one; only rank 0 sends)."""
        return refit_calls.zmq_sender(self.state).get_zmq_address()

    def stream_weights_via_ipc_zmq(
        self,
        buffer_size_bytes: int = 0,
        kv_scales: Any = None,
        *,
        timeout_s: float = 120.0,
        one_pass: bool | None = None,
        adapter_only: bool = False,
    ) -> dict[str, Any] | None:
        """One colocated refit over ZMQ + CUDA IPC (shared memory on CPU); the receiver's report.

        Under a process group every rank calls it: all ranks gather the sharded weights together
        (one tensor at a time) and rank 0 streams the full tensors to its receiver; other ranks
        return None. If rank 0's stream fails it still finishes the gathers, so the others are
        released, and every rank raises (rank 0 with the transport's error).

        ``one_pass`` (default None): the weights are cast straight into the memory the receiver
        registered (an ``HFWeightReceiver`` of an ``nn.Module`` registers by default; no
        staging; docs/refit-protocol.md, "One-pass refits"), and staged where it did not (a
        ``load_weights`` callable, the vLLM adapter). True is one-pass only (a receiver that
        did not register refuses it with ``RefitError``), False is staged only.
        ``adapter_only=True`` sends the LoRA tensors alone under PEFT's names, into a receiver
        built on ``peft_load_weights`` (`shell.refit.adapter_refit`).
        """
        opts = {"timeout_s": timeout_s, "one_pass": one_pass, "adapter_only": adapter_only}
        return refit_calls.stream_via_zmq(self.state, buffer_size_bytes, kv_scales, **opts)

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> None:
        """Join the trainer+engine process group at `ip:port` for collective refits."""
        refit_calls.init_collective(
            self.state, ip, port, world_size, train_world_size=train_world_size
        )

    def broadcast_weights_for_collective(
        self,
        kv_scales: Any = None,
        refit_timeout_s: float | None = None,
        *,
        buffer_size_bytes: int | None = None,
        num_buffers: int | None = None,
        use_legacy_packing: bool = False,
    ) -> dict[str, Any]:
        """One refit as packed broadcasts over the group of `init_collective`; a report."""
        return refit_calls.broadcast(
            self.state,
            kv_scales,
            refit_timeout_s,
            buffer_size_bytes=buffer_size_bytes,
            num_buffers=num_buffers,
            use_legacy_packing=use_legacy_packing,
        )

    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        """How many GPUs each colocated SGLang engine spans (before the first update)."""
        refit_calls.sglang_sender(self.state).set_rollout_num_gpus_per_engine(num_gpus_per_engine)

    def update_weights_to_sglang_colocated(
        self,
        *,
        rollout_engines: Any,
        buffer_size_bytes: int,
        target_precision: str = "bf16",
        sglang_quantization_cfg: Any = None,
    ) -> Any:
        """Push the weights, cast to `target_precision`, into colocated SGLang engines."""
        return refit_calls.update_sglang(
            self.state,
            rollout_engines=rollout_engines,
            buffer_size_bytes=buffer_size_bytes,
            target_precision=target_precision,
            sglang_quantization_cfg=sglang_quantization_cfg,
        )

    # ------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        *,
        is_final_checkpoint: bool = False,
    ) -> None:
        """Save weights (HF / PEFT), reference, optimizer and tokenizer; async unless final
        (docs/checkpoints.md)."""
        with quiet_progress_bars():
            checkpoint.save_checkpoint(
                self.state,
                weights_path,
                optimizer_path,
                tokenizer_path,
                is_final_checkpoint=is_final_checkpoint,
                extra_folders=self.state.draft.checkpoint_folders(weights_path, optimizer_path),
            )

    def finalize_async_save(self) -> None:
        """Block until the last save landed and its folders are renamed into place."""
        with quiet_progress_bars():
            checkpoint.finalize_async_save(self.state)

    def load_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, *, verify_digests: bool = True
    ) -> None:
        """Load weights (safetensors / DCP / PEFT, any layout), reference and optimizer state;
        nothing changes when a file is missing, truncated or differs from the save's digests
        (``verify_digests=False``: a folder another tool rewrote on purpose, loaded unchecked)."""
        with quiet_progress_bars():
            self.state.draft.check_saved(weights_path, optimizer_path)  # before anything loads
            checkpoint.load_checkpoint(
                self.state, weights_path, optimizer_path, verify_digests=verify_digests
            )
            self.state.draft.load_beside(weights_path, optimizer_path)

    # ------------------------------------------------------------------------------ misc

    def return_state_dict(self) -> dict[str, torch.Tensor]:
        """The live state dict: sharded DTensors under FSDP2 / TP (`.full_tensor()` gathers)."""
        self.state.reshard()
        return self.model.state_dict()

    def return_model_config(self) -> Any:
        """The Hugging Face config of the model."""
        return self.model.config

    def _add_noise_to_weights(self) -> None:
        """N(0, 0.01^2) noise on trainable weights, identical on every rank (a test hook)."""
        refit_calls.add_noise(self.state)

    def _reshard(self) -> None:
        """Return FSDP2 parameters to their sharded DTensors (a test seam)."""
        self.state.reshard()

    def _inference_plans(self, data: Mapping[str, Any], micro_batch_size: int | None) -> list:
        """This rank's inference microbatch plans, dummies included (a test seam)."""
        return inference.plans(self.state, data, micro_batch_size)

    def is_alive(self) -> bool:
        """True until `shutdown()` (a liveness probe for actor frameworks)."""
        return not self.state.shut_down

    def __repr__(self) -> str:
        p = self.parallel
        return (
            f"{type(self).__name__}(model={self.cfg.model_name!r}, "
            f"precision={str(self.dtype).removeprefix('torch.')}, device={self.device}, "
            f"dp×cp×tp={p.dp_size}×{p.cp_size}×{p.tp_size}, rank={p.rank}/{p.world_size}, "
            f"attention={getattr(self.model.config, '_attn_implementation', '?')!r})"
        )

    def shutdown(self) -> bool:
        """Commit a pending asynchronous save, then close the refit transports and the process
        group this worker created, for good: later batch and refit calls raise `RuntimeError`
        (a second shutdown is a no-op)."""
        if self.state.shut_down:
            return True
        checkpoint.finalize_async_save(self.state)
        self.state.saver.release_staging()  # the pinned checkpoint staging buffers
        self.state.shut_down = True
        if self.state.refit.sender is not None:
            self.state.refit.sender.close()  # closed for good: it opens no new address
        self.parallel.shutdown()
        return True


AutomodelPolicyWorker = PolicyWorker
AutomodelPolicyWorkerImpl = PolicyWorker  # NeMo-RL's name of the class behind its Ray actor

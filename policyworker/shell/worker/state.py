"""WorkerState: every resource one PolicyWorker owns, in one explicit object.

The behaviour modules (`training`, `inference`, `offload`, `weights`) take the state as their
first argument and the facade (`worker.PolicyWorker`) holds exactly one. `WorkerState.build`
validates the config against the process group first, then builds (model, LoRA, float8
linears, FSDP2/TP, fusion, optimizer, scheduler, reference snapshot, a checkpoint given at
construction), so the attrs class itself stays a plain record.

Per-worker state that used to hide in module-level dictionaries keyed by the worker lives here
too: the asynchronous checkpoint saver (`saver`), the teacher-logits buffer (`logits_buffer`)
and the refit transports (`refit`).
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
from torch.distributed.tensor import DTensor

import policyworker.shell.worker.adapters as adapters_lib
from policyworker.config import PolicyConfig, validate_for_world
from policyworker.functional.dtypes import precision_dtype
from policyworker.functional.logprob_kernels import EAGER_KERNELS, LogprobKernels
from policyworker.functional.sampling import Sampling
from policyworker.shell.checkpoint.saver import AsyncSaver
from policyworker.shell.kernels.fused_logprobs import fused_logprob_kernels
from policyworker.shell.kernels.fusion import FusionReport, fuse_elementwise
from policyworker.shell.model import hf_model as model_lib
from policyworker.shell.model.float8 import (
    Float8Report,
    apply_float8_training,
    float8_matmuls_paused,
)
from policyworker.shell.model.moe import MoeRouting
from policyworker.shell.model.optim import build_optimizer, build_scheduler
from policyworker.shell.parallel import plans as parallel_lib
from policyworker.shell.parallel.context import ParallelContext
from policyworker.shell.worker.adapters import AdapterBank
from policyworker.shell.worker.cpu_precision import warn_if_slow_cpu_precision
from policyworker.shell.worker.draft import DraftTrainer

if TYPE_CHECKING:
    from policyworker.shell.ipc_logits import TeacherLogitsBuffer
    from policyworker.shell.refit.sender import RefitSender
    from policyworker.shell.refit.sglang import SGLangColocatedSender

__all__ = ["RefitState", "WorkerState"]


@attrs.define(kw_only=True, eq=False)
class RefitState:
    """The refit transports a worker opened, each created on first use and closed at shutdown."""

    sender: RefitSender | None = None  # ZMQ + CUDA IPC / shared memory (rank 0 streams)
    collective: Any = None  # the trainer+engine group of `init_collective`
    sglang: SGLangColocatedSender | None = None


@attrs.define(kw_only=True, eq=False)
class WorkerState:
    """Model, reference weights, optimizer, scheduler, parallel context, refit and checkpoint
    state of one worker. Build it with `WorkerState.build`."""

    cfg: PolicyConfig
    parallel: ParallelContext
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    tokenizer: Any
    lora_module_names: list[str]
    fusion_report: FusionReport
    float8_report: Float8Report  # what `dtensor_cfg.fp8` converted, or why nothing
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    sampling: Sampling
    logprob_kernels: LogprobKernels  # the per-chunk logprob math: eager or fused (compiled)
    moe: MoeRouting  # MoE router hooks: gate-bias load counting, router replay
    draft: DraftTrainer  # draft co-training (inert without policy.draft)
    reference_state: dict[str, torch.Tensor] | None = None
    adapters: AdapterBank | None = None  # the parked adapters of `lora_cfg.adapters`
    refit: RefitState = attrs.Factory(RefitState)
    saver: AsyncSaver = attrs.Factory(AsyncSaver)
    logits_buffer: TeacherLogitsBuffer | None = None
    shut_down: bool = False  # set by PolicyWorker.shutdown(): later batch and refit calls raise
    # Optimizer steps applied since the worker was built: the version of its weights that
    # per-token `generation_versions` are measured against (a batch may pin `policy_version`).
    policy_version: int = 0

    @classmethod
    def build(
        cls,
        cfg: PolicyConfig,
        *,
        parallel: ParallelContext | None,
        weights_path: str | None,
        optimizer_path: str | None,
        init_optimizer: bool,
        init_reference_model: bool,
    ) -> WorkerState:
        """Validate `cfg` for this process group, then load and prepare everything it names."""
        dcfg = cfg.dtensor_cfg
        parallel = parallel or ParallelContext.from_environment(
            tp_size=dcfg.tensor_parallel_size, cp_size=dcfg.context_parallel_size
        )
        _validate(cfg, parallel)
        device, dtype = parallel.device, precision_dtype(cfg.precision)
        warn_if_slow_cpu_precision(device, dtype, rank=parallel.rank)
        weights_folder = _hf_weights_folder(weights_path)
        model, tokenizer = model_lib.load_policy_model(
            cfg, device=device, weights_from=weights_folder
        )
        lora_module_names: list[str] = []
        if dcfg.lora_cfg is not None:
            from policyworker.shell.model.lora import apply_lora

            lora_module_names = apply_lora(model, dcfg.lora_cfg, autocast_dtype=dtype)
        # float8 linears before FSDP2 (torchao's order) and before the layer compile traces them
        float8_report = apply_float8_training(
            model, dcfg.fp8, device=device, tp_size=parallel.tp_size
        )
        model = _parallelize(model, cfg, parallel, dtype)
        if cfg.sequence_packing is not None:
            with float8_matmuls_paused(model, float8_report):  # the probe tests attention
                model_lib.check_document_isolation(model, autocast_dtype=dtype)
            if parallel.mesh is not None:  # the probe's no-grad forward left roots unsharded
                parallel_lib.reshard(model)
        fusion_report = fuse_elementwise(
            model,
            mode=dcfg.fusion,
            autocast_dtype=dtype,
            distributed=parallel.mesh is not None,
            float8=float8_report.active,
        )
        sampling = Sampling.of_generation(cfg.generation)
        logprob_kernels, fusion_report = _logprob_kernels(
            model, fusion_report, device=device, dtype=dtype, sampling=sampling
        )
        optimizer = (
            build_optimizer(model, cfg.optimizer)
            if (init_optimizer and cfg.optimizer is not None)
            else None
        )
        state = cls(
            cfg=cfg,
            parallel=parallel,
            device=device,
            dtype=dtype,
            model=model,
            tokenizer=tokenizer,
            lora_module_names=lora_module_names,
            fusion_report=fusion_report,
            float8_report=float8_report,
            optimizer=optimizer,
            scheduler=build_scheduler(optimizer, cfg.scheduler) if optimizer else None,
            sampling=sampling,
            logprob_kernels=logprob_kernels,
            moe=MoeRouting(model, cfg, parallel),
            draft=DraftTrainer(
                model,
                cfg,
                device=device,
                parallel=parallel,
                build_optimizer=build_optimizer if init_optimizer else None,
            ),
        )
        copy_reference = init_reference_model and not adapters_lib.base_is_reference(state)
        state.reference_state = state.snapshot() if copy_reference else None
        if weights_path is not None or optimizer_path is not None:
            from policyworker.shell.checkpoint.api import load_checkpoint_at_init

            load_checkpoint_at_init(
                state, weights_path, optimizer_path, weights_loaded=weights_folder is not None
            )
            state.draft.load_beside(weights_path, optimizer_path)
        state.adapters = adapters_lib.build_bank(state)
        return state

    def require_running(self, call: str) -> None:
        """RuntimeError after shutdown (the process group and refit sockets are closed)."""
        if self.shut_down:
            msg = (
                f"PolicyWorker[rank={self.parallel.rank}] was shut down; {call} needs a live "
                "worker (its process group and refit sockets are closed): build a new "
                "PolicyWorker"
            )
            raise RuntimeError(msg)

    def reshard(self) -> None:
        """Return FSDP2 parameters to their sharded DTensors (after a forward without backward,
        the root's stay unsharded and `parameters()` / `state_dict()` would yield those)."""
        if self.parallel.mesh is not None:
            parallel_lib.reshard(self.model)

    def live_state(self) -> dict[str, torch.Tensor]:
        """Params + persistent buffers of the live model by state-dict name: this rank's local
        shards for DTensors (views: `copy_` into them writes the live parameters)."""
        self.reshard()
        out = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            out[k] = v.to_local() if isinstance(v, DTensor) else v
        return out

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A CPU copy of `live_state()` (pinned when CUDA exists, for fast swaps back)."""
        pin = torch.cuda.is_available()
        out = {}
        for k, t in self.live_state().items():
            cpu = t.detach().to("cpu", copy=True)
            out[k] = cpu.pin_memory() if pin else cpu
        return out

    @property
    def vocab_rows(self) -> int:
        """Rows of the input embedding: every token id fed to the model must be below this."""
        # An HF model: nn.Module's __getattr__ would type its methods/attributes Tensor | Module.
        model: Any = self.model
        embedding = model.get_input_embeddings()
        return int(getattr(embedding, "num_embeddings", None) or model.config.vocab_size)

    def resolve_device(self, device: str | torch.device) -> torch.device:
        """`device`, except that "cuda" on a machine without CUDA means the worker's device."""
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            return self.device
        return device

    def empty_cache(self) -> None:
        """Return cached accelerator blocks (nothing to do on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_memory(self) -> None:
        """Collect garbage and return cached accelerator blocks (nothing to return on CPU)."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


def _logprob_kernels(
    model: torch.nn.Module,
    report: FusionReport,
    *,
    device: torch.device,
    dtype: torch.dtype,
    sampling: Sampling,
) -> tuple[LogprobKernels, FusionReport]:
    """The logprob kernels for the fusion mode in effect, and the report saying which run."""
    # Any: get_output_embeddings is a Hugging Face method, not on torch's nn.Module.
    head = cast(Any, model).get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return EAGER_KERNELS, report  # no LM head (a reward model): nothing scores tokens
    vocab_size = int(head.weight.shape[0])
    kernels, reason = fused_logprob_kernels(
        report.effective_mode,
        device=device,
        vocab_size=vocab_size,
        logits_dtype=dtype,
        temperature=sampling.temperature,
    )
    return kernels, attrs.evolve(report, logprobs=kernels.name, logprobs_fallback_reason=reason)


def _validate(cfg: PolicyConfig, parallel: ParallelContext) -> None:
    """The rules that need the process group (the config alone was checked by `load_config`)."""
    dcfg = cfg.dtensor_cfg
    validate_for_world(cfg, dp_size=parallel.dp_size)
    if dcfg.cpu_offload and parallel.mesh is None:
        msg = (
            "dtensor_cfg.cpu_offload=True needs FSDP2, which needs a process group (this "
            "is a single process without one); launch with torchrun (even "
            "--nproc-per-node 1) or set cpu_offload: false"
        )
        raise ValueError(msg)
    if dcfg.fusion not in ("none", "auto") and parallel.mesh is not None:
        msg = (
            f"dtensor_cfg.fusion={dcfg.fusion!r} compiles the single-process model; with a "
            f"process group (world size {parallel.world_size}) FSDP2/TP own the layers, "
            "so set fusion: none there"
        )
        raise ValueError(msg)


def _parallelize(
    model: torch.nn.Module, cfg: PolicyConfig, parallel: ParallelContext, dtype: torch.dtype
) -> torch.nn.Module:
    """TP (tp > 1) then FSDP2 over dp when a process group exists; nothing for one process.

    LoRA adapters (already injected) follow their base layer's TP sharding and stay fp32
    under FSDP2 mixed precision (`parallelize_model` handles both).
    """
    if parallel.mesh is None:
        return model
    dcfg = cfg.dtensor_cfg
    model = parallel_lib.parallelize_model(
        model,
        parallel,
        precision=dtype,
        activation_checkpointing=dcfg.activation_checkpointing,
        cpu_offload=dcfg.cpu_offload,
        sequence_parallel=dcfg.sequence_parallel and parallel.tp_size > 1,
    )
    if dcfg.cpu_offload:
        parallel_lib.move_buffers(model, parallel.device)
    return model


def _hf_weights_folder(weights_path: str | None) -> str | None:
    """The HF folder to build the model from when `weights_path` holds safetensors weights."""
    if weights_path is None:
        return None
    from policyworker.shell.checkpoint import folders

    if folders.detect_weights_format(weights_path) != "safetensors":
        return None  # DCP / PEFT: built from model_name, then loaded by the checkpoint module
    return str(folders._model_folder(weights_path))

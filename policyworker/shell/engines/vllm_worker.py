"""Inside vLLM's worker: our ZMQ refit receiver as a weight-transfer backend and a worker extension.

Imported only in vLLM's processes (it imports vLLM): by vLLM's factory when the engine was built
with ``weight_transfer_config={"backend": "policyworker_zmq"}``, and by vLLM's worker when
``worker_extension_cls`` names ``PolicyWorkerVllmExtension`` (importing it also registers the
backend, so either setting alone is enough). See ``vllm.py`` for the trainer side.

vLLM's ``model.load_weights`` cannot write into a running engine's processed parameters (they
lose their ``weight_loader``); vLLM's layerwise reload restores loadable parameters, routes every
checkpoint tensor through the model's own name mapping (stacked qkv / gate_up, experts), runs the
post-load processing and copies the results back into the tensors the kernels hold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import vllm

# vLLM is an optional extra, absent from the lint environment; pyright resolves the bare
# `vllm` to our sibling module engines/vllm.py, hence the ignores on vLLM names below.
from vllm.distributed.weight_transfer.base import (  # pyright: ignore[reportMissingImports]
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (  # pyright: ignore[reportMissingImports]
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from policyworker.errors import RefitError
from policyworker.shell.engines.vllm import check_vllm_version, decode_refit_info, register_backend
from policyworker.shell.engines.vllm_checkpoint_engine import CheckpointEngineVllmMixin
from policyworker.shell.engines.vllm_logs import silence_expected_vllm_noise
from policyworker.shell.engines.vllm_lora_worker import LoraRefitExtension
from policyworker.shell.engines.vllm_shadow import KERNEL_ATTRS, ShadowWeights, shadow_unavailable
from policyworker.shell.refit.inflight import InflightWeights
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.weight_stream import DRAFT_PREFIX

# under vLLM's logger, which vLLM's processes print at INFO (the line says what a mode costs)
log = logging.getLogger("vllm.policyworker")

__all__ = [
    "PolicyWorkerVllmExtension",
    "PolicyWorkerZmqEngine",
    "ZmqInitInfo",
    "ZmqUpdateInfo",
    "layerwise_loader",
    "inflight_for",
    "receiver_for",
    "with_drafter",
]


def _cpu_moe_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(layer, experts) of every MoE layer run by vLLM's unquantized CPU experts kernel."""
    # vLLM is an optional extra, absent from the lint environment.
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (  # pyright: ignore[reportMissingImports]
        CPUUnquantizedExperts,
    )

    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            found.append((module, experts))
    return found


def _check_cpu_moe_repack(found: list[tuple[torch.nn.Module, Any]]) -> None:
    for _, experts in found:
        size = experts.moe_config.intermediate_size_per_partition
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != size:
            # pyright reads `vllm` as our sibling engines/vllm.py, which has no __version__.
            version = vllm.__version__  # pyright: ignore[reportAttributeAccessIssue]
            msg = (
                f"vLLM {version}'s CPU MoE kernel pads moe intermediate size {size} "
                f"to {padded}; its weight updates cannot be repacked in place. Use a moe "
                f"intermediate size that is a multiple of {experts._intermediate_alignment()}"
            )
            raise ValueError(msg)


def layerwise_loader(model: torch.nn.Module, model_config: Any, *, snapshot: bool = True):
    """A ``load_weights(pairs)`` that loads one complete version through vLLM's layerwise reload
    and checks that it covered every parameter of the model.

    vLLM 0.32.0's unquantized MoE method skips its experts' ``process_weights_after_loading`` on
    a weight update (it assumes GPU kernels that read the plain layout); the CPU experts kernel
    reads weights prepacked by that step, so an update left raw weights under a packed-layout
    kernel (garbage output, found by tests/engines/test_vllm_moe.py). The loader runs that prepack
    itself after the reload (same shape, new storage: there are no captured graphs on CPU).

    vLLM processes each layer as soon as its tensors have arrived, so a ``load_weights`` that
    fails midway (a name this model does not map) would leave the earlier layers on the new
    version: the loader snapshots what serves first (tensors, and the packed CPU GEMM closures
    of ``_KERNEL_ATTRS``) and puts it back on any failure. ``snapshot=False`` for a model that
    does not serve (a shadow, see ``vllm_shadow.py``): a failure there needs no rollback.
    """
    expected = {name for name, _ in model.named_parameters()}
    cpu_moe = _cpu_moe_experts(model)
    _check_cpu_moe_repack(cpu_moe)

    def load(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        serving = _snapshot(model) if snapshot else None
        try:
            initialize_layerwise_reload(model)
            try:
                # vLLM models define load_weights; torch types unknown attributes as Tensor.
                loaded = model.load_weights(iter(pairs))  # pyright: ignore[reportCallIssue]
            finally:
                finalize_layerwise_reload(model, model_config)
                for layer, experts in cpu_moe:
                    experts.process_weights_after_loading(layer)
            missing = sorted(expected - set(loaded or ()))
            if loaded is not None and missing:
                msg = (
                    f"the refit left {len(missing)} vLLM parameter(s) without a value: "
                    f"{missing[:10]}; the trainer's names do not match this vLLM model's "
                    f"checkpoint names"
                )
                raise RefitError(msg)
        except BaseException:
            if serving is not None:
                _restore(model, serving)
            raise

    return load


def _snapshot(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """What `model` serves: copies of its tensors and its packed CPU kernels."""
    with torch.no_grad():
        tensors = {name: t.detach().clone() for name, t in _serving_tensors(model)}
    kernels = [
        (module, attr, module.__dict__[attr])
        for module in model.modules()
        for attr in _KERNEL_ATTRS
        if attr in module.__dict__
    ]
    return tensors, kernels


def _restore(model: torch.nn.Module, serving: tuple[dict[str, torch.Tensor], list[Any]]) -> None:
    tensors, kernels = serving
    with torch.no_grad():
        for name, tensor in _serving_tensors(model):
            tensor.copy_(tensors[name])
    for module, attr, kernel in kernels:
        setattr(module, attr, kernel)


def with_drafter(load_policy: Any, drafter: torch.nn.Module, drafter_config: Any) -> Any:
    """A ``load_weights(pairs)`` for a stream that ends with the co-trained draft: the
    ``draft.<name>`` tensors go (prefix removed) to vLLM's speculative drafter, the others to
    the target model. Atomic over both: a target load that fails puts the drafter back."""
    load_draft = layerwise_loader(drafter, drafter_config)

    def load(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        policy, draft = [], []
        for name, tensor in pairs:
            if name.startswith(DRAFT_PREFIX):
                draft.append((name[len(DRAFT_PREFIX) :], tensor))
            else:
                policy.append((name, tensor))
        serving = _snapshot(drafter)
        load_draft(draft)  # rolls the drafter back itself when it fails
        try:
            load_policy(policy)
        except BaseException:
            _restore(drafter, serving)
            raise

    return load


# vLLM 0.32.0 on CPU: each linear layer's processing packs its weight into the closure
# `cpu_linear` (oneDNN handle or packed matrix) and leaves `weight` empty; a reload installs a
# new closure, so a rollback must put the old one back.
_KERNEL_ATTRS = KERNEL_ATTRS


def _serving_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(name, t.data if isinstance(t, torch.nn.Parameter) else t) for name, t in named]


def receiver_for(
    model: torch.nn.Module,
    model_config: Any,
    init: Mapping[str, Any],
    *,
    drafter: tuple[torch.nn.Module, Any] | None = None,
) -> HFWeightReceiver:
    """The atomic receiver of one trainer (``init``: address, refit_info, timeout_s);
    ``drafter`` is vLLM's speculative draft model and its config, when the engine has one.

    Raises:
        ValueError: ``init`` lacks a key, or its refit_info carries ``draft.<name>`` tensors
            (a co-trained draft) and the engine has no drafter to put them in.
    """
    load, info = _loader_for(model, model_config, init, drafter)
    return HFWeightReceiver(
        load,
        address=init["address"],
        refit_info=info,
        atomic=True,
        timeout_s=float(init.get("timeout_s", 120.0)),
    )


def inflight_for(
    model: torch.nn.Module,
    model_config: Any,
    init: Mapping[str, Any],
    *,
    drafter: tuple[torch.nn.Module, Any] | None = None,
) -> InflightWeights:
    """`receiver_for`'s in-flight form: refits arrive on a background thread while the engine
    keeps stepping. Where a shadow can be built (``vllm_shadow.py``: CPU, no MoE experts, no
    drafter; one extra weight set) that thread also loads each version into it and ``swap()``
    (between two engine steps) exchanges it with the live weights; elsewhere ``swap()`` loads
    the staged version through vLLM's layerwise reload, behind a rollback snapshot. Started;
    ``close()`` stops it."""
    load, info = _loader_for(model, model_config, init, drafter)
    reason = shadow_unavailable(
        model, cpu_moe=bool(_cpu_moe_experts(model)), drafter=drafter is not None
    )
    shadow = None
    if reason is None:
        shadow = ShadowWeights(
            model, lambda clone: layerwise_loader(clone, model_config, snapshot=False)
        )
        nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in info.values())
        log.info(
            "in-flight refits load into a shadow copy of the model (one more weight set, about "
            "%.1f MB); each swap exchanges it with the live weights",
            nbytes / 1e6,
        )
    else:
        log.info("in-flight refits load at each swap behind a rollback snapshot: %s", reason)
    weights = InflightWeights(
        load,
        address=init["address"],
        refit_info=info,
        timeout_s=float(init.get("timeout_s", 120.0)),
        shadow=shadow,
    )
    weights.start()
    return weights


def _loader_for(
    model: torch.nn.Module,
    model_config: Any,
    init: Mapping[str, Any],
    drafter: tuple[torch.nn.Module, Any] | None,
) -> tuple[Any, dict[str, tuple[torch.Size, torch.dtype]]]:
    for key in ("address", "refit_info"):
        if key not in init:
            msg = (
                f"init_info has no {key!r} (keys: {sorted(init)}); build it with "
                f"policyworker.shell.engines.vllm.VllmRefit"
            )
            raise ValueError(msg)
    info = decode_refit_info(init["refit_info"])
    draft_names = [name for name in info if name.startswith(DRAFT_PREFIX)]
    load = layerwise_loader(model, model_config)
    if draft_names and drafter is None:
        msg = (
            f"the trainer streams {len(draft_names)} {DRAFT_PREFIX}* tensor(s) of its "
            f"co-trained draft ({', '.join(draft_names[:3])}, ...) but this vLLM engine has no "
            f"speculative drafter to load them into; start vLLM with speculative_config="
            f"{{'method': 'eagle3', 'model': <weights_path>/draft, 'num_speculative_tokens': "
            f"k}} (a draft folder the trainer saved), or remove policy.draft from the trainer"
        )
        raise ValueError(msg)
    if draft_names and drafter is not None:
        load = with_drafter(load, *drafter)
    return load, info


def _check_single_worker(world_size: int) -> None:
    if world_size != 1:
        msg = (
            f"the policyworker_zmq backend serves one vLLM worker (tensor_parallel_size * "
            f"pipeline_parallel_size == 1), this engine has {world_size}; a ZMQ refit has "
            f"one receiver"
        )
        raise ValueError(msg)


@dataclass
class ZmqInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` carries: the trainer's ZMQ address and metadata."""

    address: str = ""
    refit_info: dict[str, list[Any]] = field(default_factory=dict)
    timeout_s: float = 120.0


@dataclass
class ZmqUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` needs nothing: the stream itself announces its manifest."""


class PolicyWorkerZmqEngine(WeightTransferEngine[ZmqInitInfo, ZmqUpdateInfo]):
    """vLLM weight-transfer backend ``policyworker_zmq``: each ``update_weights`` serves one
    complete ZMQ refit, applied at its COMPLETE through the layerwise reload (see module doc)."""

    init_info_cls = ZmqInitInfo
    update_info_cls = ZmqUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        _check_single_worker(self.parallel_config.world_size)
        self._receiver: HFWeightReceiver | None = None
        self._completed: list[dict[str, Any]] | None = None
        self.drafter: tuple[torch.nn.Module, Any] | None = None  # set by the extension

    def init_transfer_engine(self, init_info: ZmqInitInfo) -> None:
        self.shutdown()
        self._receiver = receiver_for(
            self.model, self.model_config, vars(init_info), drafter=self.drafter
        )

    def start_weight_update(self) -> None:
        if self._receiver is None:
            msg = (
                "start_weight_update before init_weight_transfer_engine; connect the trainer first"
            )
            raise RuntimeError(msg)
        self._completed = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # No device sync: the receiver's COMPLETE already waited for its copies.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ZmqUpdateInfo) -> None:
        assert self._receiver is not None and self._completed is not None
        self._completed.append(self._receiver.receive().summary())

    def finish_weight_update(self) -> None:
        if not self._completed:
            msg = (
                "finish_weight_update without a completed refit in this session; call "
                "update_weights while the trainer streams"
            )
            raise RuntimeError(msg)
        self._completed = None

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


class PolicyWorkerVllmExtension(CheckpointEngineVllmMixin, LoraRefitExtension):
    """Mixed into vLLM's worker class (``worker_extension_cls``); reached by ``collective_rpc``."""

    # Provided by the vLLM worker class this is mixed into (annotations only, no attributes).
    vllm_config: Any
    model_runner: Any

    _checkpoint_engine_loader = staticmethod(_loader_for)  # CheckpointEngineVllmMixin loads with it

    def policyworker_connect(self, init_info: dict[str, Any]) -> None:
        _check_single_worker(self.vllm_config.parallel_config.world_size)
        self.policyworker_close()
        model = self.model_runner.get_model()
        self._policyworker_receiver = receiver_for(
            model, self.vllm_config.model_config, init_info, drafter=self._policyworker_drafter()
        )

    def policyworker_attach_drafter(self) -> bool:
        """Hand vLLM's speculative drafter to this worker's ``policyworker_zmq`` backend (its
        constructor only sees the target model); whether there is one."""
        drafter = self._policyworker_drafter()
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, PolicyWorkerZmqEngine):
            engine.drafter = drafter
        return drafter is not None

    def _policyworker_drafter(self) -> tuple[torch.nn.Module, Any] | None:
        """(vLLM's speculative draft model, its model config), or None without one."""
        spec = self.vllm_config.speculative_config
        get_draft_model = getattr(self.model_runner, "get_draft_model", None)
        draft: Any = get_draft_model() if callable(get_draft_model) else None
        if spec is None or draft is None or spec.draft_model_config is None:
            return None
        return draft, spec.draft_model_config

    def policyworker_receive(self) -> dict[str, Any]:
        receiver = getattr(self, "_policyworker_receiver", None)
        if receiver is None:
            raise RuntimeError("policyworker_receive before policyworker_connect")
        return receiver.receive().summary()

    def policyworker_close(self) -> None:
        receiver = getattr(self, "_policyworker_receiver", None)
        if receiver is not None:
            receiver.close()
            self._policyworker_receiver = None

    def policyworker_connect_inflight(self, init_info: dict[str, Any]) -> None:
        """Serve this trainer's refits in flight: each one stages on a background thread while
        the engine keeps stepping; ``policyworker_swap`` makes the newest live."""
        _check_single_worker(self.vllm_config.parallel_config.world_size)
        self.policyworker_close()
        model = self.model_runner.get_model()
        self._policyworker_receiver = inflight_for(
            model, self.vllm_config.model_config, init_info, drafter=self._policyworker_drafter()
        )

    def policyworker_swap(self) -> dict[str, Any]:
        """Load the newest staged version (a collective_rpc runs between two engine steps);
        the running requests keep their KV cache. ``swapped`` is None when nothing new was
        staged; ``output_tokens`` is each running request's count of output tokens before the
        swap (tokens from that index on are sampled by ``version``)."""
        weights = getattr(self, "_policyworker_receiver", None)
        if not isinstance(weights, InflightWeights):
            raise RuntimeError("policyworker_swap before policyworker_connect_inflight")
        counts = {
            req_id: len(state.output_token_ids)
            for req_id, state in getattr(self.model_runner, "requests", {}).items()
        }
        swap = weights.swap()
        return {
            "swapped": None if swap is None else {"version": swap.version, "seconds": swap.seconds},
            "mode": weights.mode,
            "version": weights.version,
            "received": weights.received,
            "failures": weights.failures,
            "output_tokens": counts if swap is not None else {},
        }


# pyright reads `vllm` as our sibling engines/vllm.py, which has no __version__.
check_vllm_version(vllm.__version__)  # pyright: ignore[reportAttributeAccessIssue]
register_backend()
# This module is imported in vLLM's worker processes, where the refit's reload logs.
silence_expected_vllm_noise()

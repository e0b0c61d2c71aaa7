"""Inside vLLM's worker: our ZMQ refit receiver as a weight-transfer backend and a worker extension.

Imported only in vLLM's processes (it imports vLLM): by vLLM's factory when the engine was built
with ``weight_transfer_config={"backend": "policyworker_zmq"}``, and by vLLM's worker when
``worker_extension_cls`` names ``PolicyWorkerVllmExtension`` (importing it also registers the
backend, so either setting alone is enough). See ``vllm.py`` for the trainer side.

vLLM's ``model.load_weights`` cannot write into a running engine's processed parameters (they
lose their ``weight_loader``); vLLM's layerwise reload restores loadable parameters, routes every
checkpoint tensor through the model's own name mapping (stacked qkv / gate_up, experts), runs the
post-load processing and copies the results back into the tensors the kernels hold
(``vllm_reload.layerwise_loader``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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

from policyworker.shell.engines.vllm import check_vllm_version, decode_refit_info, register_backend
from policyworker.shell.engines.vllm_checkpoint_engine import CheckpointEngineVllmMixin
from policyworker.shell.engines.vllm_logs import silence_expected_vllm_noise
from policyworker.shell.engines.vllm_lora_worker import LoraRefitExtension
from policyworker.shell.engines.vllm_reload import (
    claim_for_inflight,
    cpu_moe_experts,
    layerwise_loader,
    with_drafter,
)
from policyworker.shell.engines.vllm_shadow import ShadowWeights, shadow_unavailable
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
    "inflight_for",
    "receiver_for",
]


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
    load, info = _loader_for(model, model_config, init, drafter, inflight=True)
    reason = shadow_unavailable(
        model, cpu_moe=bool(cpu_moe_experts(model)), drafter=drafter is not None
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
    claim_for_inflight((model,) if drafter is None else (model, drafter[0]), weights)
    weights.start()
    return weights


def _loader_for(
    model: torch.nn.Module,
    model_config: Any,
    init: Mapping[str, Any],
    drafter: tuple[torch.nn.Module, Any] | None,
    *,
    inflight: bool = False,
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
    load = layerwise_loader(model, model_config, inflight=inflight)
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
        load = with_drafter(load, *drafter, inflight=inflight)
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

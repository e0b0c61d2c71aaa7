"""Refit a vLLM engine from a PolicyWorker: our ZMQ stream behind vLLM's own weight-sync calls.

Two ways in, one receiver (``HFWeightReceiver`` inside vLLM's worker, see ``vllm_worker.py``):

- **weight-transfer backend** ``"policyworker_zmq"``, registered in vLLM's
  ``WeightTransferEngineFactory`` by the ``vllm.general_plugins`` entry point of this package.
  Build the engine with ``LLM(..., **engine_kwargs())`` and drive it with vLLM's four calls
  (``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` ->
  ``finish_weight_update``); ``VllmRefit`` makes those calls for you.
- **worker extension** (``worker_extension_cls``, also set by ``engine_kwargs()``): the same
  receiver reached through ``collective_rpc("policyworker_connect" / "policyworker_receive")``,
  for deployments that do not enable vLLM's weight-transfer API (``VllmRefit(via="extension")``).

The trainer side is unchanged: ``PolicyWorker.stream_weights_via_ipc_zmq`` (POSIX shared memory
on CPU, CUDA IPC on GPU) streams while vLLM's ``update_weights`` serves it in its worker.

A co-trained draft (``policy.draft``) streams as ``draft.<name>`` tensors after the policy's;
the receiver loads them into vLLM's speculative drafter (an engine started with
``speculative_config={"method": "eagle3", "model": <weights_path>/draft, ...}``: the draft
folder a checkpoint holds is a Hugging Face Eagle3 draft), in the same atomic refit. An engine
without a drafter refuses such a stream when it connects (``ValueError`` naming the tensors).

Atomicity: the receiver stages a whole version and hands it to vLLM only at COMPLETE, inside
vLLM's layerwise reload (``initialize_layerwise_reload`` -> ``model.load_weights`` ->
``finalize_layerwise_reload``), so a refit that fails midway (sender error, timeout, rejected
tensor) leaves vLLM serving the previous weights, untouched; a version vLLM itself cannot load
(a name its model does not map) is rolled back from a snapshot. The price is two copies of the
weights on the inference side during a refit.

Importing this module does not import vLLM; every function that needs it imports it and checks
its version first (``SUPPORTED_VLLM_VERSIONS``): vLLM's weight-transfer API changes between minor
versions, so other versions are refused by name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from policyworker.errors import RefitError, RefitTimeoutError, UnsupportedEngineError
from policyworker.shell.engines.vllm_support import (
    SUPPORTED_VLLM_VERSIONS,
    check_vllm_version,
    require_vllm,
)

__all__ = [
    "BACKEND_NAME",
    "EXTENSION_CLS",
    "SUPPORTED_VLLM_VERSIONS",
    "VllmRefit",
    "check_vllm_version",
    "decode_refit_info",
    "encode_refit_info",
    "engine_kwargs",
    "register_backend",
    "require_vllm",
]

BACKEND_NAME = "policyworker_zmq"
EXTENSION_CLS = "policyworker.shell.engines.vllm_worker.PolicyWorkerVllmExtension"
_VIAS = ("weight_transfer", "extension")


def register_backend() -> bool:
    """Register ``BACKEND_NAME`` with vLLM's weight-transfer factory (idempotent); the
    ``vllm.general_plugins`` entry point, run in every vLLM process.

    Returns False (and registers nothing) on an unsupported vLLM: a plugin must not break the
    engine of a user who does not use it. ``VllmRefit`` raises the version error instead.
    """
    try:
        require_vllm()
    except UnsupportedEngineError:
        return False
    # vLLM is an optional extra, absent from the lint environment.
    from vllm.distributed.weight_transfer.factory import (  # pyright: ignore[reportMissingImports]
        WeightTransferEngineFactory,
    )

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "policyworker.shell.engines.vllm_worker", "PolicyWorkerZmqEngine"
        )
    return True


def engine_kwargs() -> dict[str, Any]:
    """The ``vllm.LLM`` / ``EngineArgs`` keywords that enable both ways in."""
    return {
        "weight_transfer_config": {"backend": BACKEND_NAME},
        "worker_extension_cls": EXTENSION_CLS,
    }


def encode_refit_info(info: Mapping[str, tuple[Any, torch.dtype]]) -> dict[str, list[Any]]:
    """``prepare_refit_info()`` as plain lists and dtype names (vLLM's RPCs carry no torch
    types)."""
    from policyworker.functional.wire.codec import dtype_name

    return {name: [list(shape), dtype_name(dtype)] for name, (shape, dtype) in info.items()}


def decode_refit_info(info: Mapping[str, Any]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    from policyworker.functional.wire.codec import DTYPES_BY_NAME

    out = {}
    for name, (shape, dtype) in info.items():
        if dtype not in DTYPES_BY_NAME:
            msg = (
                f"refit_info[{name!r}] has dtype {dtype!r}; known: {sorted(DTYPES_BY_NAME)}. "
                f"Encode it with encode_refit_info(worker.prepare_refit_info())"
            )
            raise ValueError(msg)
        out[name] = (torch.Size(shape), DTYPES_BY_NAME[dtype])
    return out


def _attach_drafter(llm: Any, refit_info: Mapping[str, Any]) -> None:
    """For a stream with a co-trained draft (``draft.<name>`` tensors): hand vLLM's
    speculative drafter to the receiving backend (it sees only the target model), or raise
    before anything connects when the engine has none."""
    draft_names = [name for name in refit_info if name.startswith("draft.")]
    if not draft_names:
        return
    if all(llm.collective_rpc("policyworker_attach_drafter")):
        return
    msg = (
        f"the trainer streams {len(draft_names)} draft.* tensor(s) of its co-trained draft "
        f"({', '.join(draft_names[:3])}, ...) but this vLLM engine has no speculative drafter "
        f"to load them into; start vLLM with speculative_config={{'method': 'eagle3', "
        f"'model': <weights_path>/draft, 'num_speculative_tokens': k}} (a draft folder the "
        f"trainer saved), or remove policy.draft from the trainer"
    )
    raise ValueError(msg)


def _lora_init(sender: Any, timeout_s: float) -> dict[str, Any]:
    """What the engine's LoRA receiver needs: address, adapter manifest and adapter config."""
    from policyworker.shell.model.peft_adapter import peft_adapter_config

    cfg = getattr(sender, "cfg", None)
    lora_cfg = cfg.dtensor_cfg.lora_cfg if cfg is not None else None
    return {
        "address": sender.get_zmq_address(),
        "refit_info": encode_refit_info(sender.prepare_refit_info(adapter_only=True)),
        "peft_config": peft_adapter_config(sender.model, lora_cfg=lora_cfg),
        "timeout_s": timeout_s,
    }


def _check_lora_capacity(llm: Any, keep: int) -> None:
    """Refuse an engine without LoRA, or whose LoRA cache cannot hold `keep` versions plus the
    one a refit adds, before anything connects."""
    config = getattr(getattr(llm.llm_engine, "vllm_config", None), "lora_config", None)
    if config is None:
        msg = (
            "VllmRefit(lora=True) needs a vLLM engine with LoRA: build it with enable_lora=True, "
            "max_lora_rank >= the adapter's rank and max_loras >= keep + 1"
        )
        raise ValueError(msg)
    if config.max_cpu_loras < keep + 1:
        msg = (
            f"keep={keep} needs room for {keep + 1} adapter versions during a refit, the engine's "
            f"LoRA cache holds max_cpu_loras={config.max_cpu_loras}; build it with max_loras >= "
            f"{keep + 1} or lower keep"
        )
        raise ValueError(msg)


def _adapter_request(version: int) -> Any:
    """The ``LoRARequest`` of an adapter-only refit's version. The engine has it registered
    under this id, so it never reads the path: one that does not exist makes a lookup after an
    unexpected eviction fail by name instead of loading something else."""
    from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

    return LoRARequest(f"policy-v{version}", version, f"/policyworker-adapter-refit/v{version}")


class VllmRefit:
    """Trainer side: connects a vLLM engine to ``sender`` and runs one refit per ``refit()``.

    ``llm`` is a ``vllm.LLM`` built with ``engine_kwargs()``; ``sender`` is a ``PolicyWorker``
    (or anything with ``prepare_refit_info``, ``get_zmq_address`` and
    ``stream_weights_via_ipc_zmq``). It drives one trainer process: under a process group the
    other ranks must call ``stream_weights_via_ipc_zmq`` themselves while rank 0 calls
    ``refit()`` (tested here with one trainer process only).

    ``lora=True`` (a LoRA ``PolicyWorker``; the engine built with ``enable_lora=True`` and
    ``max_loras >= keep + 1``) refits the adapter alone: each ``refit()`` streams the LoRA tensors
    (PEFT names) into vLLM's LoRA manager, built from the tensors with no folder, and registers
    them as a new version; ``report["lora_request"]`` (also ``adapters.current``) is the
    ``LoRARequest`` new requests name. ``adapters.hold()`` keeps a version loaded for requests
    in flight; otherwise versions older than the newest ``keep`` are evicted.

    Raises:
        ValueError: the sender streams a co-trained draft (``draft.*`` tensors) and the engine
            has no speculative drafter to load them into; with ``lora=True``: the engine has no
            LoRA enabled, cannot serve the adapter (rank, features), or a LoRA module of the
            trainer reaches no LoRA layer of vLLM.
    """

    def __init__(
        self,
        llm: Any,
        sender: Any,
        *,
        via: str | None = None,
        timeout_s: float = 120.0,
        lora: bool = False,
        keep: int = 1,
    ) -> None:
        via = via if via is not None else ("extension" if lora else "weight_transfer")
        if via not in _VIAS or (lora and via != "extension"):
            msg = (
                f"via={via!r} must be one of {_VIAS} (vLLM's weight-transfer calls or "
                f"collective_rpc); lora=True takes 'extension' only (vLLM's weight-transfer "
                f"API loads base weights, adapters go into its LoRA manager)"
            )
            raise ValueError(msg)
        if not timeout_s > 0:
            msg = f"timeout_s {timeout_s} must be > 0 seconds; every wait of a refit is bounded"
            raise ValueError(msg)
        require_vllm()
        self.llm, self.sender, self.via, self.timeout_s = llm, sender, via, timeout_s
        self.lora, self.version, self.adapters = lora, 0, None
        if lora:
            from policyworker.shell.engines.vllm_lora import VllmAdapterVersions

            self.adapters = VllmAdapterVersions(llm, keep=keep)
            _check_lora_capacity(llm, keep)
            llm.collective_rpc("policyworker_connect_lora", args=(_lora_init(sender, timeout_s),))
            return
        init = {
            "address": sender.get_zmq_address(),
            "refit_info": encode_refit_info(sender.prepare_refit_info()),
            "timeout_s": timeout_s,
        }
        _attach_drafter(llm, init["refit_info"])
        if via == "weight_transfer":
            llm.init_weight_transfer_engine({"init_info": init})
        else:
            llm.collective_rpc("policyworker_connect", args=(init,))

    def refit(self, **stream_kwargs: Any) -> dict[str, Any]:
        """Stream the current weights into vLLM; the receiver's report plus ``seconds``.

        ``stream_kwargs`` go to ``stream_weights_via_ipc_zmq`` (e.g. ``buffer_size_bytes``).

        Raises:
            RefitError: vLLM's worker rejected or did not complete the refit (it keeps serving
                the previous weights); the sender's own error is chained when it has one.
            RefitTimeoutError: the sender did not finish within ``timeout_s``.
        """
        started = time.perf_counter()
        outcome: dict[str, Any] = {}

        def send() -> None:
            try:
                if self.lora:
                    stream_kwargs["adapter_only"] = True
                outcome["report"] = self.sender.stream_weights_via_ipc_zmq(
                    timeout_s=self.timeout_s, **stream_kwargs
                )
            except BaseException as exc:  # handed to the caller's thread below
                outcome["error"] = exc

        thread = threading.Thread(target=send, name="policyworker-vllm-refit", daemon=True)
        thread.start()
        received: Any = None  # the LoRA receiver's report (adapter refits only)
        try:
            if self.lora:
                (received,) = self.llm.collective_rpc(
                    "policyworker_receive_lora", args=(self.version + 1,)
                )
            elif self.via == "weight_transfer":
                self.llm.start_weight_update()
                self.llm.update_weights({"update_info": {}})
            else:
                self.llm.collective_rpc("policyworker_receive")
        except Exception as exc:
            thread.join(self.timeout_s)
            cause = outcome.get("error")
            sender = f"; the sender failed with {type(cause).__name__}: {cause}" if cause else ""
            msg = (
                f"vLLM did not take refit {self.version + 1} ({type(exc).__name__}: {exc}); "
                f"it keeps serving version {self.version}{sender}"
            )
            raise RefitError(msg) from (cause or exc)
        thread.join(self.timeout_s)
        if thread.is_alive():
            msg = (
                f"the trainer's stream_weights_via_ipc_zmq did not return within "
                f"{self.timeout_s:g} s after vLLM took the refit"
            )
            raise RefitTimeoutError(msg)
        if "error" in outcome:
            raise outcome["error"]
        self.version += 1
        report = dict(outcome.get("report") or {})
        if self.adapters is not None:
            report["lora_request"] = self.adapters.adopt(_adapter_request(self.version))
            report["engine_receive"] = received
        elif self.via == "weight_transfer":
            self.llm.finish_weight_update(weight_version=str(self.version))
        report["seconds"] = time.perf_counter() - started
        return report

"""Inside vLLM's worker: adapter-only refits straight into vLLM's LoRA manager (no folder).

`LoraRefitExtension` is mixed into ``PolicyWorkerVllmExtension`` (``vllm_worker.py``), so an
engine built with ``engine_kwargs()`` and ``enable_lora=True`` serves it through
``collective_rpc``. Each ``policyworker_receive_lora(version)`` serves one ZMQ refit of the LoRA
tensors (PEFT names) through an atomic `HFWeightReceiver`: the manifest is checked against the
``refit_info`` announced at connect, and only a complete version reaches the load step, which
builds the adapter from the tensors (``LoRAModel.from_lora_tensors``, as vLLM's own folder load
does after reading the files) and registers it under id ``version`` in the LoRA manager's CPU
cache. A request then names it with a ``LoRARequest`` of that id: vLLM finds the id registered
and never reads the request's path. A refit that fails before or during the load registers
nothing; the versions registered before keep serving.

At connect every adapter tensor must map to a module vLLM wrapped with LoRA (directly, or as a
slice of a packed one like ``qkv_proj``): vLLM applies an adapter module by module and silently
skips a name it has no layer for, which would serve the base weights there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from policyworker.errors import RefitError
from policyworker.shell.engines.vllm import decode_refit_info
from policyworker.shell.refit.receiver import HFWeightReceiver

__all__ = ["LoraRefitExtension", "VllmLoraSlots", "unreachable_lora_modules"]


def unreachable_lora_modules(
    names: Iterable[str], modules: Iterable[str], packed: Mapping[str, Iterable[str]], mapper: Any
) -> list[str]:
    """The PEFT tensor names whose module is neither a LoRA layer of vLLM (`modules`) nor a
    slice of a packed one (`packed`: packed layer -> its slices' module names)."""
    # vLLM is an optional extra, absent from the lint environment.
    from vllm.lora.utils import parse_fine_tuned_lora_name  # pyright: ignore[reportMissingImports]

    reachable = set(modules) | {name for slices in packed.values() for name in slices}
    return [n for n in names if parse_fine_tuned_lora_name(n, mapper)[0] not in reachable]


class VllmLoraSlots:
    """One trainer's adapter-only refits into a vLLM worker's LoRA manager (`manager`: the
    model runner's ``lora_manager``). ``init``: address, refit_info, peft_config, timeout_s.

    Raises:
        ValueError: ``init`` lacks a key, the adapter is not one this engine can serve (rank
            over ``max_lora_rank``, DoRA, bias), or a tensor's module is not a LoRA layer here.
    """

    def __init__(self, manager: Any, init: Mapping[str, Any]) -> None:
        # vLLM is an optional extra, absent from the lint environment.
        from vllm.lora.peft_helper import PEFTHelper  # pyright: ignore[reportMissingImports]

        for key in ("address", "refit_info", "peft_config"):
            if key not in init:
                msg = (
                    f"init_info has no {key!r} (keys: {sorted(init)}); build it with "
                    f"VllmRefit(llm, worker, lora=True)"
                )
                raise ValueError(msg)
        self.manager = manager
        models = manager._adapter_manager
        info = decode_refit_info(init["refit_info"])
        config = {
            **init["peft_config"],
            "vllm_max_position_embeddings": manager.max_position_embeddings,
        }
        self.peft_helper = PEFTHelper.from_dict(config)
        self.peft_helper.validate_legal(manager.lora_config)  # ValueError naming the rule
        mapper = getattr(models.model, "hf_to_vllm_mapper", None)
        self.mapper = mapper.get_rename_mapper() if mapper is not None else None
        missing = unreachable_lora_modules(info, models.modules, models.packed_modules, self.mapper)
        if missing:
            msg = (
                f"{len(missing)} adapter tensor(s) reach no LoRA layer of this vLLM engine: "
                f"{missing[:6]}; vLLM would serve the base weights there. Its LoRA layers: "
                f"{sorted(models.modules)[:6]}... Start vLLM with enable_lora=True and every "
                f"target module supported (or drop those targets from policy lora_cfg)"
            )
            raise ValueError(msg)
        self._version = 0
        self.receiver = HFWeightReceiver(
            self._load,
            address=init["address"],
            refit_info=info,
            atomic=True,
            timeout_s=float(init.get("timeout_s", 120.0)),
        )

    def receive(self, version: int) -> dict[str, Any]:
        """Serve one refit and register it as adapter id `version`; the receiver's report."""
        registered = self.manager.list_adapters()
        models = self.manager._adapter_manager
        if version in registered or len(registered) >= models.capacity:
            msg = (
                f"vLLM's LoRA cache cannot take adapter version {version}: registered "
                f"{sorted(registered)}, capacity max_cpu_loras={models.capacity}. Release held "
                f"versions (or raise max_cpu_loras / max_loras)"
            )
            raise RefitError(msg)
        self._version = version
        report = self.receiver.receive()
        return {
            "version": version,
            "receiver_version": report.version,
            "num_tensors": report.num_tensors,
            "num_bytes": report.num_bytes,
            "num_buckets": report.num_buckets,
            "receive_seconds": report.seconds,
        }

    def _load(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        # vLLM is an optional extra, absent from the lint environment.
        from vllm.lora.lora_model import LoRAModel  # pyright: ignore[reportMissingImports]

        manager, models = self.manager, self.manager._adapter_manager
        # The staged tensors are valid only during this call; vLLM keeps what it is given.
        tensors = {name: tensor.detach().clone() for name, tensor in pairs}
        lora = LoRAModel.from_lora_tensors(
            self._version,
            tensors,
            self.peft_helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=self.mapper,
            skip_prefixes=getattr(models.model, "lora_skip_prefixes", None),
        )
        models._validate_modules_to_save(lora)
        models.add_adapter(lora)  # the one effect: the version is registered or it is not

    def close(self) -> None:
        self.receiver.close()


class LoraRefitExtension:
    """Worker-extension calls of adapter-only refits (mixed into vLLM's worker class)."""

    # Provided by the vLLM worker class this is mixed into (annotations only, no attributes).
    vllm_config: Any
    model_runner: Any

    def policyworker_connect_lora(self, init_info: dict[str, Any]) -> None:
        world = self.vllm_config.parallel_config.world_size
        if world != 1:
            msg = (
                f"adapter-only refits serve one vLLM worker (tensor_parallel_size * "
                f"pipeline_parallel_size == 1), this engine has {world}"
            )
            raise ValueError(msg)
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            msg = (
                "this vLLM engine has no LoRA manager; start it with enable_lora=True, "
                "max_lora_rank >= the adapter's rank and max_loras >= VllmRefit's keep"
            )
            raise ValueError(msg)
        self.policyworker_close_lora()
        self._policyworker_lora = VllmLoraSlots(manager, init_info)

    def policyworker_receive_lora(self, version: int) -> dict[str, Any]:
        slots = getattr(self, "_policyworker_lora", None)
        if slots is None:
            raise RuntimeError("policyworker_receive_lora before policyworker_connect_lora")
        return slots.receive(int(version))

    def policyworker_close_lora(self) -> None:
        slots = getattr(self, "_policyworker_lora", None)
        if slots is not None:
            slots.close()
            self._policyworker_lora = None

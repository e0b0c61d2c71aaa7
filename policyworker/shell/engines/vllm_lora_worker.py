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
skips a name it has no layer for, which would serve the base weights there. Each tensor's in /
out features must equal its layer's, and the adapter must be one the engine serves (rank within
``max_lora_rank``, no DoRA or bias): checked there too, before the previous connection closes,
so a refused connect changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from policyworker.errors import RefitError
from policyworker.shell.engines.vllm import decode_refit_info
from policyworker.shell.refit.receiver import HFWeightReceiver

__all__ = [
    "LoraRefitExtension",
    "VllmLoraSlots",
    "lora_layer_dims",
    "mismatched_lora_shapes",
    "unreachable_lora_modules",
]


def unreachable_lora_modules(
    names: Iterable[str], modules: Iterable[str], packed: Mapping[str, Iterable[str]], mapper: Any
) -> list[str]:
    """The PEFT tensor names whose module is neither a LoRA layer of vLLM (`modules`) nor a
    slice of a packed one (`packed`: packed layer -> its slices' module names)."""
    # vLLM is an optional extra, absent from the lint environment.
    from vllm.lora.utils import parse_fine_tuned_lora_name  # pyright: ignore[reportMissingImports]

    reachable = set(modules) | {name for slices in packed.values() for name in slices}
    return [n for n in names if parse_fine_tuned_lora_name(n, mapper)[0] not in reachable]


def lora_layer_dims(modules: Mapping[str, Any], packed: Mapping[str, Any]) -> dict[str, tuple]:
    """``{module: (in_features, out_features)}`` of every plain linear LoRA layer of vLLM (each
    slice of a packed one under its own name), read from the slots its adapters are copied into;
    embeddings, logits and MoE experts are left out (their adapters have other layouts)."""
    dims: dict[str, tuple] = {}
    for name, module in modules.items():
        a, b = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        kind = type(module).__name__
        if a is None or b is None or "Embedding" in kind or "Logits" in kind or "MoE" in kind:
            continue
        # one stacked tensor per slice; a plain layer may hold its one tensor bare
        a = (a,) if isinstance(a, torch.Tensor) else tuple(a)
        b = (b,) if isinstance(b, torch.Tensor) else tuple(b)
        slices = list(packed.get(name, [name]))
        if len(slices) != len(a) or len(slices) != len(b):
            continue  # a packing vLLM slices otherwise (e.g. qkv + z)
        for i, sliced in enumerate(slices):
            dims[sliced] = (a[i].shape[-1], b[i].shape[-2])
    return dims


def mismatched_lora_shapes(
    info: Mapping[str, tuple[Any, Any]], dims: Mapping[str, tuple], mapper: Any
) -> list[str]:
    """``name: shape, expected`` for each ``lora_A`` [r, in] / ``lora_B`` [out, r] of `info`
    whose module is in `dims` and whose in / out features differ from vLLM's layer."""
    # vLLM is an optional extra, absent from the lint environment.
    from vllm.lora.utils import parse_fine_tuned_lora_name  # pyright: ignore[reportMissingImports]

    problems = []
    for name, (shape, _) in info.items():
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        if module not in dims or len(shape) != 2:
            continue
        in_features, out_features = dims[module]
        got, want = (shape[1], in_features) if is_a else (shape[0], out_features)
        if got != want:
            side = "in_features" if is_a else "out_features"
            problems.append(f"{name}: {list(shape)}, vLLM's layer has {side}={want}")
    return problems


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
        dims = lora_layer_dims(models.modules, models.packed_modules)
        wrong = mismatched_lora_shapes(info, dims, self.mapper)
        if wrong:
            msg = (
                f"{len(wrong)} adapter tensor(s) do not fit this vLLM engine's LoRA layers: "
                f"{wrong[:6]}; the trainer's model and the engine's must have the same shapes"
            )
            raise ValueError(msg)
        self._version, self._info = 0, info
        self._timeout_s = float(init.get("timeout_s", 120.0))
        self._address = init["address"]
        self.receiver: HFWeightReceiver | None = None

    def connect(self) -> None:
        """Start the receiver (after every check passed: a refused connect changes nothing)."""
        self.receiver = HFWeightReceiver(
            self._load,
            address=self._address,
            refit_info=self._info,
            atomic=True,
            timeout_s=self._timeout_s,
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
        if self.receiver is None:
            raise RuntimeError("receive before connect")
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
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


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
        slots = VllmLoraSlots(manager, init_info)  # every check before anything changes
        self.policyworker_close_lora()
        slots.connect()
        self._policyworker_lora = slots

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

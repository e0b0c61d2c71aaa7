"""Loading one complete version into a running vLLM model through its layerwise reload.

``layerwise_loader(model, model_config)`` is the ``load_weights(pairs)`` every refit path of the
worker (``vllm_worker.py``) and the checkpoint engine's rollout side hand their receivers. It is
atomic on a serving model (a snapshot of what serves, restored on any failure), checks that every
parameter and every layer got its tensors, repacks the CPU MoE experts vLLM's reload skips, and
refuses to write a model an open in-flight connection owns (``claim_for_inflight``): that
connection's version count and staged version assume nothing else writes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import vllm

# vLLM is an optional extra, absent from the lint environment; pyright resolves the bare
# `vllm` to our sibling module engines/vllm.py, hence the ignores on vLLM names below.
from vllm.model_executor.model_loader.reload import (  # pyright: ignore[reportMissingImports]
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.layerwise import (  # pyright: ignore[reportMissingImports]
    LAYERWISE_INFO,
)

from policyworker.errors import RefitError
from policyworker.shell.engines.vllm_shadow import KERNEL_ATTRS
from policyworker.shell.refit.inflight import InflightWeights
from policyworker.shell.refit.weight_stream import DRAFT_PREFIX

__all__ = ["claim_for_inflight", "cpu_moe_experts", "layerwise_loader", "with_drafter"]

# Models whose live weights an open in-flight connection owns: its version count and its
# staged (or shadow-loaded) version assume nothing else writes them.
_INFLIGHT_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, InflightWeights] = (
    weakref.WeakKeyDictionary()
)


def claim_for_inflight(models: Iterable[torch.nn.Module], weights: InflightWeights) -> None:
    """From now until ``weights`` closes, only loaders built with ``inflight=True`` write
    ``models``."""
    for model in models:
        _INFLIGHT_OWNERS[model] = weights


def cpu_moe_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
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


def layerwise_loader(
    model: torch.nn.Module, model_config: Any, *, snapshot: bool = True, inflight: bool = False
):
    """A ``load_weights(pairs)`` that loads one complete version through vLLM's layerwise reload
    and checks that it covered every parameter and every layer of the model.

    vLLM 0.32.0's unquantized MoE method skips its experts' ``process_weights_after_loading`` on
    a weight update (it assumes GPU kernels that read the plain layout); the CPU experts kernel
    reads weights prepacked by that step, so an update left raw weights under a packed-layout
    kernel (garbage output, found by tests/engines/test_vllm_moe.py). The loader runs that prepack
    itself after the reload (same shape, new storage: there are no captured graphs on CPU).

    vLLM processes each layer as soon as its tensors have arrived, so a ``load_weights`` that
    fails midway (a name this model does not map) would leave the earlier layers on the new
    version: the loader snapshots what serves first (tensors, and the packed CPU GEMM closures
    of ``KERNEL_ATTRS``: each reload installs new ones) and puts it back on any failure.
    ``snapshot=False`` for a model that does not serve (a shadow, see ``vllm_shadow.py``): a
    failure there needs no rollback. A layer whose parameters ``load_weights`` reports loaded
    but that got no element of them (vLLM puts its previous tensors back and only warns) fails
    the load too.

    While an in-flight connection owns ``model`` (``inflight_for``), only its own loader
    (``inflight=True``) may write it: any other refit is refused before it changes a weight.
    """
    expected = {name for name, _ in model.named_parameters()}
    cpu_moe = cpu_moe_experts(model)
    _check_cpu_moe_repack(cpu_moe)

    def load(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not inflight:
            _refuse_while_inflight(model)
        serving = _snapshot(model) if snapshot else None
        try:
            initialize_layerwise_reload(model)
            try:
                # vLLM models define load_weights; torch types unknown attributes as Tensor.
                loaded = model.load_weights(iter(pairs))  # pyright: ignore[reportCallIssue]
                untouched = _layers_given_nothing(model, loaded)
            finally:
                finalize_layerwise_reload(model, model_config)
                for layer, experts in cpu_moe:
                    experts.process_weights_after_loading(layer)
            if untouched:
                msg = (
                    f"the refit gave {len(untouched)} vLLM layer(s) no element of their "
                    f"parameters ({untouched[:5]}); vLLM keeps their previous tensors, so the "
                    f"result would mix versions"
                )
                raise RefitError(msg)
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


def _layers_given_nothing(model: torch.nn.Module, loaded: Iterable[str] | None) -> list[str]:
    """Layers still waiting for their first element after ``load_weights`` although it reports
    loading their parameters: their loaders passed the tensors on to another layer's reload
    state, which dropped them (vLLM then puts the layer's previous tensors back). ``loaded``
    None (a model whose ``load_weights`` reports nothing): nothing to compare with."""
    reported = set(loaded or ())
    waiting = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or info.load_numel > 0:
            continue
        if any(f"{name}.{param}" in reported for param in info.restore_metadata[0]):
            waiting.append(name)
    return waiting


def _refuse_while_inflight(model: torch.nn.Module) -> None:
    owner = _INFLIGHT_OWNERS.get(model)
    if owner is not None and not owner.closed:
        msg = (
            "this vLLM worker serves in-flight refits (policyworker_connect_inflight): a refit "
            "by another path would change the live weights behind the in-flight version count, "
            "and the next swap would put the older staged version back. Refit through "
            "VllmInflightRefit.stage()/swap(), or close it (VllmInflightRefit.close()) first"
        )
        raise RefitError(msg)


def _snapshot(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """What `model` serves: copies of its tensors and its packed CPU kernels."""
    with torch.no_grad():
        tensors = {name: t.detach().clone() for name, t in _serving_tensors(model)}
    kernels = [
        (module, attr, module.__dict__[attr])
        for module in model.modules()
        for attr in KERNEL_ATTRS
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


def with_drafter(
    load_policy: Any, drafter: torch.nn.Module, drafter_config: Any, *, inflight: bool = False
) -> Any:
    """A ``load_weights(pairs)`` for a stream that ends with the co-trained draft: the
    ``draft.<name>`` tensors go (prefix removed) to vLLM's speculative drafter, the others to
    the target model. Atomic over both: a target load that fails puts the drafter back."""
    load_draft = layerwise_loader(drafter, drafter_config, inflight=inflight)

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


def _serving_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(name, t.data if isinstance(t, torch.nn.Parameter) else t) for name, t in named]

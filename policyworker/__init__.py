"""policyworker: the training side of LLM reinforcement learning as a library.

What a user imports lives here: the worker, the receiver, the losses, the data dict, the config
loaders, the Ray worker group, the vLLM refit and the errors
(`from policyworker import PolicyWorker, ClippedPGLossFn`). The names are resolved on first use
(PEP 562), so `import policyworker` imports neither torch, transformers, Ray nor vLLM and has no
side effects.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PolicyWorker": "policyworker.shell.worker.policy_worker",
    "AutomodelPolicyWorker": "policyworker.shell.worker.policy_worker",
    "AutomodelPolicyWorkerImpl": "policyworker.shell.worker.policy_worker",
    "HFWeightReceiver": "policyworker.shell.refit.receiver",
    "PolicyConfig": "policyworker.config",
    "load_config": "policyworker.config",
    "load_config_file": "policyworker.config.files",
    "RayWorkerGroup": "policyworker.shell.ray.group",
    "make_placement_group": "policyworker.shell.ray.actor",
    "VllmRefit": "policyworker.shell.engines.vllm",
    "BatchedDataDict": "policyworker.data",
    "ClippedPGLossFn": "policyworker.functional.loss",
    "DPOLossFn": "policyworker.functional.loss",
    "NLLLoss": "policyworker.functional.loss",
    "NLLLossFn": "policyworker.functional.loss",
    "DistillationLossFn": "policyworker.functional.distillation",
    "LossFunction": "policyworker.functional.loss",
    "LossInputType": "policyworker.functional.loss",
    "LossType": "policyworker.functional.loss",
    "CheckpointError": "policyworker.shell.checkpoint.layout",
    "ConfigError": "policyworker.errors",
    "DataError": "policyworker.errors",
    "LoRAMergeError": "policyworker.errors",
    "RefitError": "policyworker.errors",
    "RefitTimeoutError": "policyworker.errors",
    "TransportError": "policyworker.errors",
    "UnknownParameterError": "policyworker.errors",
    "UnsupportedEngineError": "policyworker.errors",
    "UnsupportedModelError": "policyworker.errors",
    "WorkerGroupError": "policyworker.errors",
    "WorkerGroupTimeoutError": "policyworker.errors",
    "encode_refit_info": "policyworker.functional.dtypes",
    "decode_refit_info": "policyworker.functional.dtypes",
    "flatten_train_metrics": "policyworker.functional.metrics",
    "set_verbosity": "policyworker.shell.logs",
}

# Derived from _LAZY so the names are listed once; pyright cannot follow a computed __all__.
__all__ = sorted([*_LAZY, "__version__"])  # pyright: ignore[reportUnsupportedDunderAll]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        msg = f"module 'policyworker' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

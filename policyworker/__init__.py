"""policyworker: the training side of LLM reinforcement learning as a library.

Public names are resolved lazily, so `import policyworker` imports neither torch nor
transformers and has no side effects.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "AutomodelPolicyWorker",
    "BatchedDataDict",
    "PolicyConfig",
    "PolicyWorker",
    "__version__",
    "decode_refit_info",
    "encode_refit_info",
    "flatten_train_metrics",
    "load_config",
    "set_verbosity",
]

_LAZY = {
    "PolicyWorker": ("policyworker.shell.worker", "PolicyWorker"),
    "AutomodelPolicyWorker": ("policyworker.shell.worker", "AutomodelPolicyWorker"),
    "PolicyConfig": ("policyworker.config", "PolicyConfig"),
    "load_config": ("policyworker.config", "load_config"),
    "BatchedDataDict": ("policyworker.data", "BatchedDataDict"),
    "encode_refit_info": ("policyworker.functional.dtypes", "encode_refit_info"),
    "decode_refit_info": ("policyworker.functional.dtypes", "decode_refit_info"),
    "flatten_train_metrics": ("policyworker.functional.metrics", "flatten_train_metrics"),
    "set_verbosity": ("policyworker.shell.logs", "set_verbosity"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        msg = f"module 'policyworker' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    module_name, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

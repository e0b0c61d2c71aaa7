"""policyworker.shell.model.hf_model."""

from typing import Any

# The names other code imports from this face, resolved on first use (PEP 562): the face imports
# none of its modules eagerly, so importing one of them never runs another through the face.
_LAZY = {
    "LinearLoRA": "policyworker.shell.model.lora",
    "apply_lora": "policyworker.shell.model.lora",
    "autocast_context": "policyworker.shell.model.hf_model",
    "lora_modules": "policyworker.shell.model.lora",
    "lora_parameters": "policyworker.shell.model.lora",
    "resolve_compute_dtype": "policyworker.shell.model.lora",
}
__all__ = sorted(_LAZY)  # pyright: ignore[reportUnsupportedDunderAll]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value

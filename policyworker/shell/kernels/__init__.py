"""policyworker.shell.kernels."""

from typing import Any

# The names other code imports from this face, resolved on first use (PEP 562): the face imports
# none of its modules eagerly, so importing one of them never runs another through the face.
_LAZY = {
    "FUSION_MODES": "policyworker.shell.kernels.fusion",
    "TRITON_KERNELS": "policyworker.shell.kernels.logprob_triton",
    "fused_logprob_kernels": "policyworker.shell.kernels.fused_logprobs",
    "inductor_kernels": "policyworker.shell.kernels.fused_logprobs",
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

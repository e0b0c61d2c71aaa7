"""policyworker.shell.kernels."""

from policyworker._lazy import lazy_exports

# The names other code imports from this face, each resolved on first use
__getattr__, __all__ = lazy_exports(  # pyright: ignore[reportUnsupportedDunderAll]
    __name__,
    {
        "FUSION_MODES": "policyworker.shell.kernels.fusion",
        "TRITON_KERNELS": "policyworker.shell.kernels.logprob_triton",
        "fused_logprob_kernels": "policyworker.shell.kernels.fused_logprobs",
        "inductor_kernels": "policyworker.shell.kernels.fused_logprobs",
    },
)

"""policyworker.shell.refit.one_pass."""

from policyworker._lazy import lazy_exports

# The names other code imports from this face, each resolved on first use
__getattr__, __all__ = lazy_exports(  # pyright: ignore[reportUnsupportedDunderAll]
    __name__,
    {
        "OnePassWriter": "policyworker.shell.refit.one_pass.sender",
    },
)

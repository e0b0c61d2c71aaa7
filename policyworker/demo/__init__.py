"""`policyworker demo`: GRPO on a toy task with a separate inference process (see loop.py)."""

from policyworker._lazy import lazy_exports

# The names other code imports from this face, each resolved on first use
__getattr__, __all__ = lazy_exports(  # pyright: ignore[reportUnsupportedDunderAll]
    __name__,
    {"generate_tagged": "policyworker.demo.inference"},
)

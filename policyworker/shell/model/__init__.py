"""policyworker.shell.model.hf_model."""

from policyworker._lazy import lazy_exports

# The names other code imports from this face, each resolved on first use
__getattr__, __all__ = lazy_exports(  # pyright: ignore[reportUnsupportedDunderAll]
    __name__,
    {
        "LinearLoRA": "policyworker.shell.model.lora",
        "apply_lora": "policyworker.shell.model.lora",
        "autocast_context": "policyworker.shell.model.hf_model",
        "lora_modules": "policyworker.shell.model.lora",
        "lora_parameters": "policyworker.shell.model.lora",
        "resolve_compute_dtype": "policyworker.shell.model.lora",
    },
)

"""Exceptions of policyworker: one class per kind of failure a caller may want to catch."""

__all__ = [
    "ConfigError",
    "DataError",
    "LoRAMergeError",
    "RefitError",
    "RefitTimeoutError",
    "TransportError",
    "UnknownParameterError",
    "UnsupportedEngineError",
]


class ConfigError(ValueError):
    """A config mapping did not describe a valid config. One line per problem, each with its path."""


class DataError(ValueError):
    """A BatchedDataDict is missing a key or has shapes/dtypes the worker cannot use."""


class UnknownParameterError(KeyError):
    """A parameter name has no known mapping (e.g. to a Hugging Face checkpoint name)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class LoRAMergeError(RuntimeError):
    """A LoRA module cannot be merged into its base weight (e.g. the weight name is unreachable)."""


class TransportError(RuntimeError):
    """A weight transport failed (socket error, peer gone, protocol violation)."""


class RefitError(TransportError):
    """A refit was rejected or failed; carries the receiver's reason when it has one."""


class RefitTimeoutError(RefitError, TimeoutError):
    """A refit wait ran past its deadline; the message names rank, phase and address."""


class UnsupportedEngineError(RuntimeError):
    """An inference engine is missing, or installed at a version this adapter was not built for."""

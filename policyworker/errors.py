"""Exceptions of policyworker: one class per kind of failure a caller may want to catch."""

__all__ = [
    "ConfigError",
    "DataError",
    "LoRAMergeError",
    "RefitError",
    "RefitTimeoutError",
    "TransportError",
    "UnknownParameterError",
    "UnsupportedModelError",
    "WorkerGroupError",
    "WorkerGroupTimeoutError",
    "UnsupportedEngineError",
]


class ConfigError(ValueError, AssertionError):
    """A config mapping did not describe a valid config.

    One line per problem, each with its path. Also an `AssertionError`, what NeMo-RL raises for
    a bad config, so code catching NeMo-RL's failure catches this one.
    """


class DataError(ValueError, KeyError, AssertionError):
    """A BatchedDataDict is missing a key or has shapes/dtypes the worker cannot use.

    Also a `KeyError` and an `AssertionError`, what NeMo-RL raises for a missing key and a bad
    shape, so code catching NeMo-RL's failures catches this one; the message reads as written.
    """

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class UnsupportedModelError(ValueError):
    """A model architecture (``config.model_type``) the operation is not verified for."""


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


class WorkerGroupError(RuntimeError):
    """A call on a group of workers failed on one rank; names the rank and the method.

    `rank` and `method` say where; the rank's own exception, when it raised one, is `__cause__`.
    """

    def __init__(self, message: str, *, rank: int | None = None, method: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.method = method


class WorkerGroupTimeoutError(WorkerGroupError, TimeoutError):
    """A group call (or the group's start) did not finish within its timeout."""


class UnsupportedEngineError(RuntimeError):
    """An inference engine is missing, or installed at a version this adapter was not built for."""

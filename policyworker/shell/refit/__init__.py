"""Refit: pushing the trainer's weights into inference engines.

    sender.py          RefitSender: a worker's ZMQ refit (refit info, address, one stream call)
    weight_stream.py   the weights to send: HF names, target dtypes, gathered shards, in order
    live_state.py      the state-dict walk a refit makes, without torch's per-module overhead
    hf_names.py        a model's checkpoint names and layout, asked of transformers
    receiver.py        HFWeightReceiver: the inference side applying a refit
    weight_applier.py  WeightApplier: check every batch against the manifest, then write it
    watchdog.py        a deadline that names the phase which ran past it
    zmq/               ZMQ + CUDA IPC / shared-memory transport (staged, ping-pong buffers)
    one_pass/          the trainer casts straight into the receiver's registered arena
    collective/        packed broadcast over a trainer + engine process group
    sglang/            colocated SGLang updates

The wire format both sides speak is pure and lives in the core: `policyworker.functional.wire`.
"""

from typing import Any

# The names other code imports from this face, resolved on first use (PEP 562): the face imports
# none of its modules eagerly, so importing one of them never runs another through the face.
_LAZY = {
    "RefitSender": "policyworker.shell.refit.sender",
    "RefitSource": "policyworker.shell.refit.weight_stream",
    "iter_refit_sources": "policyworker.shell.refit.weight_stream",
    "refit_specs": "policyworker.shell.refit.weight_stream",
    "refit_stream": "policyworker.shell.refit.weight_stream",
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

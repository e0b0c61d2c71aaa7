"""Refit: pushing the trainer's weights into inference engines.

    sender.py          RefitSender: a worker's ZMQ refit (refit info, address, one stream call)
    weight_stream.py   the weights to send: HF names, target dtypes, gathered shards, in order
    live_state.py      the state-dict walk a refit makes, without torch's per-module overhead
    hf_names.py        a model's checkpoint names and layout, asked of transformers
    receiver.py        HFWeightReceiver: the inference side applying a refit
    inflight.py        InflightWeights: stage refits while sampling, swap between decode steps
    weight_applier.py  WeightApplier: check every batch against the manifest, then write it
    watchdog.py        a deadline that names the phase which ran past it
    zmq/               ZMQ + CUDA IPC / shared-memory transport (staged, ping-pong buffers)
    one_pass/          the trainer casts straight into the receiver's registered arena
    collective/        packed broadcast over a trainer + engine process group
    sglang/            colocated SGLang updates

The wire format both sides speak is pure and lives in the core: `policyworker.functional.wire`.
"""

from policyworker._lazy import lazy_exports

# The names other code imports from this face, each resolved on first use
__getattr__, __all__ = lazy_exports(  # pyright: ignore[reportUnsupportedDunderAll]
    __name__,
    {
        "InflightWeights": "policyworker.shell.refit.inflight",
        "adapter_stream": "policyworker.shell.refit.adapter_refit",
        "RefitSender": "policyworker.shell.refit.sender",
        "RefitSource": "policyworker.shell.refit.weight_stream",
        "iter_refit_sources": "policyworker.shell.refit.weight_stream",
        "refit_specs": "policyworker.shell.refit.weight_stream",
        "refit_stream": "policyworker.shell.refit.weight_stream",
    },
)

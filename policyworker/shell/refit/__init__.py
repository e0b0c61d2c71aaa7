"""Refit: pushing the trainer's weights into inference engines.

    sender.py       RefitSender: a worker's ZMQ refit (refit info, address, one stream call)
    params.py       the weights to send: HF names, target dtypes, gathered shards, in order
    live_state.py   the state-dict walk a refit makes, without torch's per-module overhead
    hf_names.py     the checkpoint names and layout of a model, asked of transformers; the
                    supported architectures (others are refused by model_type)
    wire.py         the wire format (JSON headers, manifests, dtype names); nothing is pickled
    wire_messages.py  the protocol's message records, limits and dtype table
    wire_checks.py    the manifest and bucket checks a receiver runs before writing
    zmq_ipc.py      ZMQ + CUDA IPC / shared-memory transport: names the five modules below
    ipc_files.py    socket folders, /dev/shm staging files, orphan removal, OS limits
    staging.py      ping-pong staging buffers (shm / CUDA) and the grouped copies
    zmq_sender.py   ZmqIpcSender: the trainer's REQ socket and the sending state machine
    refit_server.py RefitServer: the receiver's state machine (no socket) and its buffers
    zmq_receiver.py ZmqIpcReceiver: the receiver's REP socket loop
    receiver.py     HFWeightReceiver: the inference side applying a refit (ZMQ and in-process)
    weight_applier.py  WeightApplier: check every batch against the manifest, then write it
    shared_buffers.py  opening a peer's shared buffer (/dev/shm file or CUDA IPC handle)
    one_pass_receiver.py  WeightArena: a receiver's weights moved into one registered arena
    one_pass_sender.py    OnePassWriter: cast the master weights straight into that arena
    wire_one_pass.py      the registration on the wire (JSON + handle frames)
    collective.py   packed broadcast over a trainer+engine process group: building the group,
                    the worker glue, and every name of the three modules below
    collective_plan.py      the header both sides agree on, its codec, the bucket plan
    collective_group.py     CollectiveRefit: the group, bounded waits, the trainer's broadcast
    collective_receiver.py  CollectiveWeightReceiver: the inference side
    sglang.py       colocated SGLang updates (serialized named tensors per engine)
    sglang_payload.py  SGLang's flattened_bucket payload: build, read, safe unpickling
    watchdog.py     a deadline that names the phase which ran past it

`policyworker.shell.refit` was once the sender module: its names stay importable from here.
"""

from typing import Any

_SENDER_NAMES = (
    "CPU_DEFAULT_BUFFER_BYTES",
    "CUDA_DEFAULT_BUFFER_CAP_BYTES",
    "RefitSender",
    "check_stream_args",
)


def __getattr__(name: str) -> Any:
    if name in _SENDER_NAMES:
        from policyworker.shell.refit import sender

        return getattr(sender, name)
    msg = f"module 'policyworker.shell.refit' has no attribute {name!r}"
    raise AttributeError(msg)

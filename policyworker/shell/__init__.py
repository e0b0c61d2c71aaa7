"""The imperative shell: models, process groups, transports and files, a folder per layer.

Layers import downwards only (tests/property/test_architecture.py checks it):

    ray/            RayWorkerGroup: PolicyWorker as a group of Ray actors (extra "ray")
    worker/         PolicyWorker, the facade (policy_worker.py), its NeMo-RL surface, the
                    worker's state, and the behaviours it calls: training, inference and the
                    scoring loop, offload, calibration, the refit calls, microbatches, drafts
    checkpoint/     HF safetensors + DCP checkpoints with an atomic commit
    engines/        adapters to inference engines (vLLM)
    parallel/       ParallelContext, FSDP2/TP plans, collectives over shards
    kernels/        the layer compile (fusion), fused logprob kernels (inductor and Triton)
    model/          HF model loading, attention, LoRA (+TP, PEFT export), MoE, drafts, optim
    refit/          weights into inference engines: the weight stream, receivers, and a folder
                    per transport (zmq/, one_pass/, collective/, sglang/)
    ipc_logits.py   full logits handed to a colocated consumer over CUDA IPC / shared memory
    logs.py         the package's logger and verbosity

`worker/` never imports `ray/` or `engines/`; `model/` and `kernels/` never import `worker/`.
"""

"""The pure core: tensors and plain values in, tensors and plain values out; no effects.

Nothing here communicates, reads the clock or the environment, or mutates an argument; rank,
device and dtype arrive as arguments. Import modules explicitly (this face re-exports nothing):

    arena.py              one-pass refit memory layout: where each receiver tensor lives
    batch_checks/         the one check of a train / inference batch
    batching.py           microbatch plans: fixed, token-budget, packed; dummies; reordering
    buckets.py            refit bucket plans and byte-exact packing into a uint8 buffer
    context_parallel.py   head-tail balanced context-parallel sharding of the sequence dim
    data_checks.py        batch shapes and keys at the edge, the loss-object check
    distillation.py       on-policy distillation loss over the teacher's top-k
    dpo_loss.py           DPO over interleaved (chosen, rejected) rows
    dtypes.py             precision names and the refit dtype rule
    fp8.py                FP8 (e4m3) scale arithmetic
    logprob_kernels.py    per-chunk next-token logprob forward / backward math
    logprobs.py           chunked fp32 log-softmax, sampling filters, vocab-parallel partials
    lora.py               LoRA scale, delta, exact merge / unmerge, PEFT names
    loss.py               the losses by their NeMo-RL names (NLL here; re-exports the others)
    loss_inputs.py        reading a loss's inputs: logprobs, [:, 1:] slices, masks
    loss_options.py       ClippedPGConfig, DPOConfig and the config reader
    loss_protocol.py      the loss contract: LossType, LossInputType, LossFunction
    loss_terms.py         masked means, KL estimators, importance weights, PG metrics
    metrics.py            how microbatch metrics combine into step metrics
    moe.py                MoE gate-bias update and router replay math
    names.py              parameter names: wrapper prefixes, LoRA, HF layout
    packing.py            pack / unpack rows, cu_seqlens, positions, bin packing
    padding.py            masks, lengths, position ids, left / right padding
    pg_loss.py            the clipped policy-gradient loss (GRPO / PPO / GSPO / CISPO)
    safetensors_layout.py which HF tensors a state has and where each byte goes
    sampling.py           generation settings and vLLM's top-k / top-p filters
    tokens.py             which tokens count (normalizers, -inf check, reward read-out)
    topk.py               local and merged top-k logits
    vocab_parallel.py     per-shard log-softmax partials and the row/vocab all-to-all
    wire/                 the refit wire codec and its checks
    worker_group.py       node-local ranks and representatives of a worker group
"""

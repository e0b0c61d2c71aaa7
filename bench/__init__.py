"""Benchmarks of the worker against named baselines and physical limits.

Each is a module run from the repository root, `python -m bench.<name> [--small] [--json PATH]`,
that imports the library only through its public faces (`policyworker`, the core's modules,
`policyworker.shell.<package>`) and writes one result file of the row schema (`bench.rows`).
`policyworker bench` runs them all and prints one table; `bench/run_gpu.sh` runs the GPU parts.

    common.py          shapes, random model folders, timing, memory, MFU, the text table
    rows.py            the row schema every bench writes: ours, baseline (named), limit, ratio
    gpu_gaps.py        where a profiled call's GPU sat idle, blamed on the launching host op
    train_step.py      a packed train step vs plain HF, MFU, fusion and LoRA variants
      train_step_baselines.py   the plain HF loop and Liger's kernels in our worker
      train_step_rows.py        its rows: ours vs plain HF, MFU, fusion / LoRA / Liger
    logprobs.py        get_logprobs vs plain HF and Liger at 16k-32k tokens
    lora.py            LoRA vs full fine-tuning; the merge cost at refit
    refit.py           the ZMQ / one-pass refit vs a per-tensor sender and the copy ceiling
      refit_baselines.py        shapes, the receiving process, per-tensor baseline, ceilings
    refit_overhead.py  the refit's host-side Python per call
    checkpoint.py      sync / async saves and loads vs the raw disk
      checkpoint_report.py      its text table and schema rows
    fsdp_overhead.py   FSDP2 on one rank vs the plain model
    ray_overhead.py    the Ray actor's cost per call vs the worker in-process
    moe.py             MoE models through the worker
"""

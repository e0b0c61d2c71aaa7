"""bench/lora_adapters.py: its figures become rows the runner judges, and its pieces run."""

import torch

from bench.lora_adapters import RANK, adapter_model, small_shapes, summary_rows
from policyworker._dev.bench_table import normalize_rows, row_verdict
from policyworker.shell.refit.adapter_refit import adapter_stream


def _judged(result):
    rows = normalize_rows("b", {"rows": summary_rows(result), "settings": {}})
    return {r.metric: r for r in rows}


def test_the_7b_adapter_rows_carry_the_time_and_bytes_targets():
    shape = {
        "shape": "qwen2.5-7b",
        "adapter_s": 0.0008,
        "adapter_bytes": 150,
        "adapter_bf16_s": 0.0006,
        "adapter_bf16_bytes": 75,
        "full_s": 0.02,
        "full_bytes": 10_000,
    }
    multi = {"num_adapters": 2, "per_adapter_tokens_per_s": 85.0, "single_tokens_per_s": 100.0}
    result = {
        "device": "NVIDIA H100",
        "refits": [shape],
        "n_adapters": multi,
        "vllm_cpu_engine": {"zmq_s": 0.01, "folder_s": 0.05},
    }
    rows = _judged(result)
    # the targets sit on the bf16 rows (what a bf16 worker sends); the fp32 rows carry none
    time = rows[
        f"adapter-only refit, qwen2.5-7b rank {RANK} (bf16, the default) vs merged full refit"
    ]
    assert (time.ours, time.unit, row_verdict(time)) == (0.6, "ms", "pass")
    size = rows[
        f"adapter-only refit bytes, qwen2.5-7b rank {RANK} (bf16, the default) vs merged full refit"
    ]
    assert size.ratio == 0.0075 and row_verdict(size) == "pass"
    fp32 = rows[f"adapter-only refit bytes, qwen2.5-7b rank {RANK} (fp32) vs merged full refit"]
    assert fp32.ratio == 0.015 and row_verdict(fp32) not in ("pass", "fail")
    per_adapter = rows["train tokens/s per adapter, 2 adapters on one base vs one"]
    assert per_adapter.ratio == 0.85 and row_verdict(per_adapter) == "fail"
    assert any(m.startswith("vLLM CPU engine") for m in rows)
    cpu = _judged({**result, "device": "cpu"})
    assert row_verdict(cpu[time.metric]) is None  # no time target off the GPU


def test_the_adapter_model_streams_every_linear_at_rank_16_under_peft_names():
    model = adapter_model(small_shapes(), "cpu")
    specs = adapter_stream(model, dtype=torch.float32).specs
    assert len(specs) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    assert all(s.name.startswith("base_model.model.model.layers.") for s in specs)
    assert {s.shape[0] for s in specs if ".lora_A." in s.name} == {RANK}
    assert {s.dtype for s in adapter_stream(model, dtype=torch.bfloat16).specs} == {torch.bfloat16}

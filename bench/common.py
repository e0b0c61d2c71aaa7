"""Shared pieces of the worker benchmarks: model shapes, RL length mixes, timing, tables, JSON.

A random Qwen2.5-1.5B-shaped model (vocab 151936) is built directly on the device in bf16 and
saved once into a temporary folder, so the worker loads it by path like any HF checkpoint.
`--small` swaps in a tiny Qwen2 shape and short sequences so every benchmark runs on a CPU in
seconds (a smoke test of the code path, not a measurement).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.rows import write_result
from policyworker.testing import tiny_model

REPO = Path(__file__).resolve().parent.parent  # the checkout: results go to bench/results
# The H200's device-to-device copy rate measured here (KINDS.md): the memory limit of the kernel
# rows where no GPU measures its own (`copy_ceiling_bytes_per_s`; an H100 copies about 3.0e12)
COPY_CEILING_BYTES_PER_S = 4.2e12

# measured bf16 matmul ceiling of one H200 here (KINDS.md); the H100s here ran 779-798 TFLOP/s
BF16_PEAK_FLOPS = 790e12

QWEN25_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
# An 8B-class shape that trains on one H200 with LoRA (fp32 master base weights ~30 GB).
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    rope_theta=1e6,
)
SHAPES = {"1.5b": QWEN25_15B, "7b": QWEN25_7B}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def save_random_model(folder: Path, *, small: bool, seed: int = 0, shape: str = "1.5b") -> int:
    """Save a random Qwen2 model (bf16 on disk) into `folder`; return its parameter count.

    `shape` names one of `SHAPES` (ignored with `small`).
    """
    keys = TINY if small else SHAPES[shape]
    model = tiny_model("qwen2", seed=seed, dtype=torch.bfloat16, device=device(), **keys)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    release()
    return num_params


def rl_lengths(num_rows: int, *, low: int, high: int, seed: int) -> list[int]:
    """Sequence lengths uniform in [low, high] (an RL rollout length mix)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (num_rows,), generator=gen).tolist()


def make_batch(
    lengths: Sequence[int], *, vocab: int, seed: int, seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-padded random ids with token/sample masks for `lengths` (CPU tensors)."""
    seq_len = seq_len or max(lengths)
    gen = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    valid = torch.arange(seq_len)[None] < lengths_t[:, None]
    ids = torch.randint(0, vocab, (len(lengths), seq_len), generator=gen) * valid
    token_mask = valid.float()
    token_mask[:, 0] = 0
    return {
        "input_ids": ids,
        "input_lengths": lengths_t,
        "token_mask": token_mask,
        "sample_mask": torch.ones(len(lengths)),
    }


def release() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# torch.profiler leaves CUPTI attached when it stops (kineto finalizes it only when
# TEARDOWN_CUPTI=1), and every kernel launch after that costs more for the rest of the process:
# pytorch/pytorch#144455 reports 10-20 % slower training. On the H200 (12-05), a LoRA worker timed
# after a profiled worker in the same process ran 45,427 tok/s, alone 50,609 (0.90x). So a bench
# profiles only after its last timed row, and `timed` refuses to time after a profile unless
# the call says it measures exactly that.
_profile_ran = False


def mark_profiled() -> None:
    """Record that torch.profiler ran in this process (`gpu_gaps.print_profile` calls it)."""
    global _profile_ran
    _profile_ran = True


def timed(
    fn: Callable[[], Any], *, repeats: int, warmup: int = 1, after_profile: bool = False
) -> tuple[float, Any]:
    """Median seconds of `repeats` calls after `warmup` calls, and the last result.

    Raises RuntimeError once a profile has run in this process, unless `after_profile` (the
    caller measures what the profiler leaves behind)."""
    if _profile_ran and not after_profile:
        raise RuntimeError(
            "timed() after torch.profiler ran in this process: the profiler leaves CUPTI "
            "attached and later launches slower, so this row would measure that; profile after "
            "the last timed row, or pass after_profile=True to measure the slowdown itself"
        )
    result = None
    for _ in range(warmup):
        result = fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def device_seconds_per_call(fn: Callable[[], Any], *, calls: int) -> float:
    """Seconds per call of `fn` (CUDA, warmed up by the caller), launched back to back between
    two CUDA events: for kernels of tens of microseconds, where `timed`'s host sync per call
    would be as long as the kernel."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def copy_ceiling_bytes_per_s(nbytes: int = 1 << 30, copies: int = 20) -> float:
    """This GPU's device-to-device copy rate, bytes read plus written per second, measured now:
    the limit of a memory-bound kernel on the card the row ran on. `COPY_CEILING_BYTES_PER_S`
    without CUDA (smoke runs)."""
    if not torch.cuda.is_available():
        return COPY_CEILING_BYTES_PER_S
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / device_seconds_per_call(lambda: dst.copy_(src), calls=copies)


def peak_extra_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes allocated at the peak of `fn()` beyond what was allocated before it.

    CUDA only; 0 on CPU.
    """
    if not torch.cuda.is_available():
        return 0, fn()
    sync()
    release()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    sync()
    return torch.cuda.max_memory_allocated() - before, result


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def mfu(num_params: int, tokens: int, seconds: float, *, flops_per_param: float = 6.0) -> float:
    """Model FLOPs utilization: `flops_per_param` * N * tokens / seconds over the bf16 ceiling.

    6 for full training (forward 2, backward 4); 4 when the base weights are frozen (LoRA: the
    backward computes activation gradients only; the adapters' own FLOPs are under 1 %).
    """
    return flops_per_param * num_params * tokens / seconds / BF16_PEAK_FLOPS


def gib(num_bytes: float) -> float:
    return num_bytes / 2**30


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Rows of {metric, ours, baseline, limit, ratio} as an aligned text table."""
    cols = ("metric", "ours", "baseline", "limit", "ratio")

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def ratio(ours: float | None, baseline: float | None) -> float | None:
    if ours is None or baseline in (None, 0):
        return None
    return ours / baseline


def write_results(name: str, payload: dict[str, Any], out: str | None = None) -> Path:
    """Write `payload` (the row schema, `bench.rows`) as JSON to bench/results/<name>.json (or
    `out`)."""
    return write_result(Path(out) if out else REPO / "bench" / "results" / f"{name}.json", payload)

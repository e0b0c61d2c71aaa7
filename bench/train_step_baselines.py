"""The train step's baselines: the plain Hugging Face loop (AdamW, sdpa, autocast) and Liger's
Qwen2 kernels swapped into our worker (the field's kernel library beside our layer compile).
See `bench.train_step` for the rows they make."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from bench.common import device, gib, is_oom, make_batch, mfu, peak_bytes, release, timed
from policyworker import PolicyWorker
from policyworker.shell.kernels import fused_logprob_kernels

__all__ = ["bench_plain_hf", "liger_layers"]


@contextlib.contextmanager
def liger_layers(worker: PolicyWorker) -> Iterator[None]:
    """Liger's Qwen2 kernels (RMSNorm, SwiGLU MLP, RoPE; not its loss) in `worker`'s model and
    our fused logprob kernels (those the default config runs) for the block. Liger also
    replaces names in transformers' modeling_qwen2 (RoPE is looked up there at each call); they
    are put back after it, so every other row runs Hugging Face's own code."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2  # a bench-only wheel
    from transformers.models.qwen2 import modeling_qwen2

    replaced = ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP")
    saved = {name: getattr(modeling_qwen2, name) for name in replaced}
    try:
        apply_liger_kernel_to_qwen2(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=False,  # the worker scores tokens itself
            model=worker.model,
        )
        kernels, reason = fused_logprob_kernels(
            "layer",
            device=worker.device,
            vocab_size=worker.model.config.vocab_size,
            logits_dtype=worker.dtype,
            temperature=worker.state.sampling.temperature,
        )
        if reason is not None:
            raise RuntimeError(f"our fused logprob kernels fell back to eager: {reason}")
        worker.state.logprob_kernels = kernels
        yield
    finally:
        for name, value in saved.items():
            setattr(modeling_qwen2, name, value)


def bench_plain_hf(model_path: str, args, lengths: list[int], num_params: int) -> dict:
    """The plain loop; {'oom': True} when it does not fit."""
    import transformers

    release()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    dev = device()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="sdpa"
    ).to(dev)
    model.config.use_cache = False
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-6, weight_decay=0.01, fused=dev.type == "cuda"
    )
    data = make_batch(lengths, vocab=model.config.vocab_size, seed=1, seq_len=args.max_len)
    ids, mask = data["input_ids"].to(dev), data["token_mask"].to(dev)
    dtype = torch.bfloat16 if args.precision == "bfloat16" else torch.float32

    def step() -> float:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=ids, use_cache=False).logits
        lp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    tokens = sum(lengths)
    try:
        seconds, loss = timed(step, repeats=args.steps)
        out = {
            "tokens_per_s": tokens / seconds,
            "mfu": mfu(num_params, tokens, seconds),
            "step_s": seconds,
            "peak_gib": gib(peak_bytes()),
            "loss": loss,
            "oom": False,
        }
    except RuntimeError as exc:
        if not is_oom(exc):
            raise
        out = {"oom": True, "peak_gib": gib(peak_bytes())}
    model = opt = ids = mask = None  # the last references (step() closes over them)
    release()
    return out

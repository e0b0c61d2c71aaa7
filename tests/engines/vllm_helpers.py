"""Shared by the vLLM tests: tiny models vLLM's CPU kernels run, one engine, HF references.

vLLM's CPU attention takes head_dim 64 (it refuses 16), so the tiny models here have hidden 128
and 2 heads. Each engine runs in vLLM's default CPU layout, engine core and worker in their own
processes (each imports vLLM: 40-160 s to start on 2 busy cores). Not in this process: vLLM's
worker initialises torch.distributed, and a PolicyWorker in the same process would then take
that group for its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Sequence

import pytest
import torch

# One GiB of KV cache (the default takes a share of RAM on a machine shared by several users);
# OpenMP threads left unpinned (vLLM would pin its worker to one core and reserve the other).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=False,
)
PROMPTS = [[3, 17, 42, 9], [5, 6, 7, 8, 99, 100], [120, 4]]


def require_vllm() -> None:
    """Skip the module where vLLM is not installed, except in CI (`make venv` installs it)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("CI"):
        raise RuntimeError("vLLM is not installed in CI's venv; `make venv` must install it")
    pytest.skip(
        "vLLM is not installed in this venv (`make venv` installs it)", allow_module_level=True
    )


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Wider-than-default random matrices, so logprobs are far from uniform and greedy is stable."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def tiny_model(config, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)


@contextlib.contextmanager
def engine(model_dir: str, *, in_process: bool = False, **extra) -> Iterator[object]:
    """A float32 eager vLLM engine with both policyworker refit paths enabled.

    `in_process`: engine core and worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    a start of a few seconds instead of two processes importing vLLM; only for a test that
    builds no PolicyWorker (vLLM's worker initialises torch.distributed here).
    """
    from vllm import LLM

    from policyworker.shell.engines.vllm import engine_kwargs

    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENGINE_ENV.items():
            mp.setenv(key, value)
        if in_process:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = LLM(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=64,
            skip_tokenizer_init=True,
            seed=0,
            max_num_seqs=32,
            **engine_kwargs(),
            **extra,
        )
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()


def generate(
    llm,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> list[tuple[list[int], list[float]]]:
    """(token ids, each sampled token's logprob) per prompt."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        logprobs=0,
        seed=seed,
        detokenize=False,
        ignore_eos=True,
    )
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    result = []
    for out in outs:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        result.append((ids, [d[t].logprob for d, t in zip(completion.logprobs, ids, strict=True)]))
    return result


@torch.no_grad()
def hf_continuation(
    model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]
) -> tuple[list[int], list[float]]:
    """(greedy token at each generated position, logprob of each given token): one fp32 forward."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
    finally:
        torch.set_num_threads(threads)
    n = len(prompt)
    rows = logp[n - 1 : n - 1 + len(tokens)]
    picked = rows.gather(-1, torch.tensor(list(tokens))[:, None])[:, 0]
    return rows.argmax(-1).tolist(), picked.tolist()

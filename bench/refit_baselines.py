"""What the refit benches send and compare with: model shapes built as bare state dicts, the
receiving process, the per-tensor baseline, and the copy ceilings and cast floor (the limits).

Used by `bench.refit` and `bench.refit_overhead`; see `bench.refit` for what each row means.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from policyworker.functional.buckets import IpcBucket, align_up
from policyworker.shell.refit import RefitSender, iter_refit_sources, refit_specs
from policyworker.shell.refit.zmq import CudaStaging, ShmStaging, grouped_copy_

SHAPES = {
    # hidden, intermediate, layers, heads, kv_heads, vocab, tied
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "tiny": (64, 176, 4, 4, 2, 1024, False),
    # the 7B names and tensor count, every dimension / 64 (bench/refit_overhead.py)
    "qwen2.5-7b/64": (56, 296, 28, 28, 4, 2376, False),
    # the 1.5B names and tensor count, every dimension / 64: a refit's fixed host cost on CPU
    # (``--small --shapes qwen2.5-1.5b/64 --profile``)
    "qwen2.5-1.5b/64": (24, 140, 28, 12, 2, 2374, True),
}
REPEATS = 3


def state_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """HF state-dict shapes of a Qwen2-architecture model."""
    hidden, inter, layers, heads, kv_heads, vocab, tied = SHAPES[name]
    kv = hidden // heads * kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def build_module(
    shapes: dict[str, tuple[int, ...]], *, dtype: torch.dtype, device: str, random: bool
) -> nn.Module:
    """A bare module whose state_dict has exactly these names and shapes."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        data = torch.empty(shape, dtype=dtype, device=device)
        if random:
            data.normal_()
        node.register_parameter(leaf, nn.Parameter(data, requires_grad=False))
    return root


def run_receiver(args: argparse.Namespace) -> None:
    from policyworker import HFWeightReceiver
    from policyworker.functional.wire.codec import DTYPES_BY_NAME

    torch.set_num_threads(1)
    spec = json.loads(Path(args.spec).read_text())
    device = spec["device"]
    target = build_module(
        {n: tuple(s) for n, s in spec["shapes"].items()},
        dtype=torch.bfloat16,
        device=device,
        random=False,
    )
    info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in spec["refit_info"].items()}
    receiver = HFWeightReceiver(
        target,
        address=spec["address"],
        refit_info=info,
        timeout_s=300,  # one_pass left at its default: a module registers (and serves staged)
    )
    print("READY", flush=True)
    for _ in range(spec["num_refits"]):
        receiver.receive()
    receiver.close()


def per_tensor_stream(sender: RefitSender, model: nn.Module, cuda: bool, timeout_s: float) -> None:
    """One buffer, one IPC handle and one round trip per tensor, over the same protocol code."""
    specs = refit_specs(model, torch.bfloat16)
    plan = [IpcBucket((i,), (s.name,), (0,), align_up(s.nbytes), True) for i, s in enumerate(specs)]
    device = sender.device

    def make_staging(nbytes: int) -> CudaStaging | ShmStaging:
        return CudaStaging(nbytes, device) if cuda else ShmStaging(nbytes)

    sender._zmq().stream(
        specs,
        plan,
        iter_refit_sources(model, torch.bfloat16),
        make_staging=make_staging,
        buffer_bytes=max(p.used_bytes for p in plan),
        timeout_s=timeout_s,
        transport="cuda" if cuda else "shm",
    )


def copy_ceiling(model: nn.Module, dest: dict[str, torch.Tensor], cuda: bool) -> None:
    """Cast into a staging tensor, then staging → destination; no protocol, no second process."""
    largest = max(t.numel() for t in dest.values())
    staging = torch.empty(largest, dtype=torch.bfloat16, device=next(iter(dest.values())).device)
    for name, source in model.state_dict().items():
        slot = staging[: source.numel()].view(source.shape)
        slot.copy_(source)
        dest[name].copy_(slot)
    if cuda:
        torch.cuda.synchronize()


def one_pass_ceiling(
    model: nn.Module,
    dest: dict[str, torch.Tensor],
    cuda: bool,
    route: str = "grouped",
    gpu_spans: list[float] | None = None,
) -> None:
    """Cast every fp32 source straight into its bf16 destination; no protocol, one process.

    ``route``: ``grouped`` launches as the sender does (``grouped_copy_``), ``alone`` one
    ``copy_`` per tensor, ``one group`` a single ``_foreach_copy_`` over every tensor. On CUDA,
    ``gpu_spans`` gets the seconds from the first cast's start to the last one's end on the GPU
    (the wall time less the host's walk before the first launch)."""
    state = model.state_dict()
    dsts, srcs = list(dest.values()), [state[n] for n in dest]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
    if events:
        events[0].record()
    if route == "grouped":
        grouped_copy_(dsts, srcs)
    elif route == "alone":
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
    else:
        torch._foreach_copy_(dsts, srcs)  # pyright: ignore[reportPrivateImportUsage]
    if events:
        events[1].record()
        torch.cuda.synchronize()
        if gpu_spans is not None:
            gpu_spans.append(events[0].elapsed_time(events[1]) / 1e3)


# the one-pass ceiling's launch routes (``one_pass_ceiling``) and the names of their rows
ROUTE_ROWS = {
    "grouped": "one-pass-ceiling",
    "alone": "one-pass-ceiling, alone",
    "one group": "one-pass-ceiling, one group",
}
FLOOR_ELEMENTS = 1 << 28


def cast_floor(model_elements: int, device: str, cuda: bool) -> list[float]:
    """Seconds to cast ``model_elements`` fp32 → bf16 at the rate of one big contiguous cast
    (``FLOOR_ELEMENTS`` at a time, scaled): the bytes' cost with no per-tensor structure."""
    block = min(FLOOR_ELEMENTS, model_elements)
    src = torch.empty(block, dtype=torch.float32, device=device).normal_()
    dst = torch.empty(block, dtype=torch.bfloat16, device=device)

    def cast() -> None:
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()

    return [t * model_elements / block for t in timed(cast, cuda)]


def timed(fn, cuda: bool) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(REPEATS):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out

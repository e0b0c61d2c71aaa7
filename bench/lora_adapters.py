"""LoRA as the product surface: adapter-only refits against the merged full refit, the vLLM
engine's adapter refit, and several adapters trained on one base.

- **adapter-only refit** (Qwen2.5 1.5B and 7B shapes, rank 16 on every linear but lm_head):
  one ZMQ refit of the LoRA tensors alone under PEFT's names (what
  ``stream_weights_via_ipc_zmq(adapter_only=True)`` sends: `adapter_refit.adapter_stream`, in
  the full refit's dtype, bf16 under bf16 precision; an fp32 row beside it)
  into an ``HFWeightReceiver`` in another process (CUDA IPC on a GPU, shared memory on CPU),
  against the full-weight refit of the same shape (every weight in bf16 from fp32 masters: what
  a merged LoRA refit sends; the merge itself is not counted, so the baseline is a lower bound).
  Both steady state (``keep_staging=True``), median of `REPEATS` after a warm-up. A bf16 row
  sends the adapters in bf16 (half the bytes; an engine serving bf16 casts to that anyway).
- **vLLM CPU engine** (``--part vllm``, a tiny Llama, CPU only: vLLM's CPU wheel): seconds of
  ``VllmRefit(llm, worker, lora=True).refit()`` (tensors over ZMQ, built in vLLM's LoRA manager)
  against ``VllmAdapterVersions.publish()`` (a PEFT folder written, then ``add_lora`` reads it).
- **N adapters on one base**: train tokens/s of a worker with ``lora_cfg.adapters`` (the
  adapters trained alternately, one ``train(..., adapter=name)`` call each) per adapter,
  against a single-adapter worker on the same model and batch.

    python -m bench.lora_adapters                 # GPU: 1.5B and 7B shapes, writes JSON
    python -m bench.lora_adapters --part refit    # only the refit rows (or --part adapters)
    python -m bench.lora_adapters --small         # CPU smoke shapes
    python -m bench.lora_adapters --part vllm     # the vLLM CPU engine row (vLLM's CPU wheel)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from bench.common import QWEN25_15B, TINY, release, save_random_model, timed
from bench.refit_baselines import build_module, state_shapes
from bench.rows import row, write_result

RANK, ALPHA, REPEATS = 16, 32, 5
SHAPE_NAMES = ("qwen2.5-1.5b", "qwen2.5-7b")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY_LLAMA = dict(  # vLLM's CPU attention takes head_dim 64
    vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
    tie_word_embeddings=False,
)  # fmt: skip


def adapter_model(shapes: dict[str, tuple[int, ...]], device: str) -> nn.Module:
    """A module holding a rank-`RANK` `LinearLoRA` at every linear of `shapes` but lm_head;
    the frozen base weights stay on the meta device (an adapter refit never reads them)."""
    from policyworker.shell.model import LinearLoRA

    root = nn.Module()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in shapes.items():
        *path, module, leaf = name.split(".")
        if leaf != "weight" or module not in LINEARS:
            continue
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        out_features, in_features = shape
        layer = LinearLoRA(
            in_features, out_features, bias=False, dim=RANK, alpha=ALPHA, device="meta"
        )
        for adapter in (layer.lora_A, layer.lora_B):
            adapter.to_empty(device=device)
            with torch.no_grad():
                adapter.weight.normal_(generator=gen)
        node.add_module(module, layer)
    return root


def run_receiver(spec_path: str) -> None:
    """The child process: an ``HFWeightReceiver`` serving `num_refits` refits."""
    from policyworker import HFWeightReceiver
    from policyworker.functional.wire.codec import DTYPES_BY_NAME

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    info = {n: (tuple(s), DTYPES_BY_NAME[d]) for n, (s, d) in spec["refit_info"].items()}
    dtype = next(iter(info.values()))[1]
    shapes = {n: s for n, (s, _) in info.items()}
    target = build_module(shapes, dtype=dtype, device=spec["device"], random=False)
    receiver = HFWeightReceiver(target, address=spec["address"], refit_info=info, timeout_s=300)
    print("READY", flush=True)
    for _ in range(spec["num_refits"]):
        receiver.receive()
    receiver.close()


def _timed_refits(sender, info, send, device: str) -> float:
    """Median seconds of `send()` into a receiver process built from `info`."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        encoded = {n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()}
        spec.write_text(
            json.dumps(
                {
                    "device": device,
                    "address": sender.get_zmq_address(),
                    "refit_info": encoded,
                    "num_refits": REPEATS + 1,
                }
            )
        )
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.lora_adapters",
                "--role",
                "receiver",
                "--spec",
                str(spec),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "READY"
            seconds, _ = timed(send, repeats=REPEATS)
            child.wait(timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
            sender.release_staging()
    return seconds


def _adapter_refit(shapes: dict, device: str, dtype: torch.dtype) -> dict:
    from policyworker.shell.refit import RefitSender, adapter_stream

    lora = adapter_model(shapes, device)
    sender = RefitSender(lambda: lora, dtype, device=device)
    specs = adapter_stream(lora, dtype=dtype).specs
    info = {s.name: (torch.Size(s.shape), s.dtype) for s in specs}

    def send() -> None:  # the worker's adapter_only refit: the sender's cached adapter walk
        stream = sender.adapter_stream()
        sender.send(stream, stream.sources, buffer_size_bytes=0, timeout_s=300, keep_staging=True)

    try:
        seconds = _timed_refits(sender, info, send, device)
    finally:
        sender.close()
    return {"s": seconds, "bytes": sum(s.nbytes for s in specs), "tensors": len(specs)}


def _full_refit(shapes: dict, device: str) -> dict:
    from policyworker.shell.refit import RefitSender

    full = build_module(shapes, dtype=torch.float32, device=device, random=True)
    sender = RefitSender(lambda: full, torch.bfloat16, device=device)
    info = sender.prepare_refit_info()

    def send() -> None:
        sender.stream_weights_via_ipc_zmq(timeout_s=300, keep_staging=True)

    try:
        seconds = _timed_refits(sender, info, send, device)
    finally:
        sender.close()
    return {"s": seconds, "bytes": sum(s.numel() * d.itemsize for s, d in info.values())}


def refit_shape(name: str, device: str, *, small: bool) -> dict:
    """Adapter-only (fp32 and bf16) and full-weight refit seconds and bytes of one shape."""
    shapes = small_shapes() if small else state_shapes(name)
    result: dict = {"shape": "tiny" if small else name, "rank": RANK}
    for label, dtype in (("adapter", torch.float32), ("adapter_bf16", torch.bfloat16)):
        for key, value in _adapter_refit(shapes, device, dtype).items():
            result[f"{label}_{key}"] = value
        release()
    for key, value in _full_refit(shapes, device).items():
        result[f"full_{key}"] = value
    release()
    return result


def small_shapes() -> dict[str, tuple[int, ...]]:
    hidden, inter, layers = TINY["hidden_size"], TINY["intermediate_size"], 2
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (TINY["vocab_size"], hidden)}
    for i in range(layers):
        for module, shape in (
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (hidden // 2, hidden)),
            ("self_attn.v_proj", (hidden // 2, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (inter, hidden)),
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):
            shapes[f"model.layers.{i}.{module}.weight"] = shape
    return shapes


def _worker(model_dir: str, *, adapters: tuple[str, ...], batch: int, cuda: bool):
    from policyworker import PolicyWorker

    lora = {"dim": RANK, "alpha": ALPHA, "match_all_linear": True, "adapters": list(adapters)}
    cfg = {
        "model_name": model_dir,
        "precision": "bfloat16" if cuda else "float32",
        "train_global_batch_size": batch,
        "train_micro_batch_size": batch,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6, "weight_decay": 0.0}},
        "dtensor_cfg": {"lora_cfg": lora},
    }
    return PolicyWorker(cfg, init_reference_model=False)


def n_adapters(*, small: bool, num: int, batch: int, seq: int) -> dict:
    """Train tokens/s per adapter: `num` adapters trained alternately vs a single adapter."""
    from bench.common import make_batch
    from policyworker.functional.loss import NLLLoss

    cuda = torch.cuda.is_available() and not small
    vocab = TINY["vocab_size"] if small else QWEN25_15B["vocab_size"]
    data = make_batch([seq] * batch, vocab=vocab, seed=0)
    loss, names = NLLLoss(), tuple(f"a{i}" for i in range(num))
    # a tiny CPU step lasts milliseconds: more repeats, or the ratio is mostly noise
    repeats = 10 if small else 3
    result: dict = {"num_adapters": num, "batch": batch, "seq": seq}
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(Path(tmp), small=small)
        worker = _worker(tmp, adapters=(), batch=batch, cuda=cuda)
        seconds, _ = timed(lambda: worker.train(data, loss), repeats=repeats, warmup=2)
        result["single_tokens_per_s"] = batch * seq / seconds
        worker.shutdown()
        del worker
        release()
        worker = _worker(tmp, adapters=names, batch=batch, cuda=cuda)

        def round_robin() -> None:
            for name in names:
                worker.train(data, loss, adapter=name)

        seconds, _ = timed(round_robin, repeats=repeats, warmup=2)
        result["per_adapter_tokens_per_s"] = num * batch * seq / seconds
        worker.shutdown()
    release()
    return result


def vllm_engine_refit(repeats: int = 9) -> dict:
    """Seconds of an adapter refit into vLLM's CPU engine: over ZMQ vs through a PEFT folder."""
    import statistics
    import time

    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM

    from bench.common import make_batch
    from policyworker import PolicyWorker
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.engines import VllmAdapterVersions, VllmRefit, engine_kwargs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(f"{tmp}/model")
        lora = {"target_modules": ["q_proj", "v_proj", "down_proj"], "dim": 8, "alpha": 16}
        worker = PolicyWorker(
            {
                "model_name": f"{tmp}/model",
                "precision": "float32",
                "train_global_batch_size": 2,
                "train_micro_batch_size": 2,
                "dtensor_cfg": {"lora_cfg": lora},
            },
            init_reference_model=False,
        )
        worker.train(make_batch([8, 8], vocab=128, seed=0), NLLLoss())
        llm = LLM(
            model=f"{tmp}/model", dtype="float32", enforce_eager=True, max_model_len=64,
            skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8, max_loras=2,
            **engine_kwargs(),
        )  # fmt: skip
        try:
            refit = VllmRefit(llm, worker, lora=True, keep=1)
            zmq = [refit.refit()["seconds"] for _ in range(repeats + 1)][1:]
            versions = VllmAdapterVersions(llm, worker, root=f"{tmp}/adapters", keep=1)
            versions.version = refit.version  # ids continue after the refit's versions
            folder = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                versions.publish()
                folder.append(time.perf_counter() - start)
        finally:
            llm.llm_engine.engine_core.shutdown()
            worker.shutdown()
    return {"zmq_s": statistics.median(zmq), "folder_s": statistics.median(folder[1:])}


def summary_rows(r: dict) -> list[dict]:
    rows = []
    for shape in r.get("refits", []):
        name, is7b = shape["shape"], shape["shape"] == "qwen2.5-7b"
        # bf16 is what a bf16-precision worker sends (its full refit's dtype); fp32 is shown for
        # a float32 worker and carries no target.
        for label, key in (("fp32", "adapter"), ("bf16, the default", "adapter_bf16")):
            targeted = is7b and key == "adapter_bf16"
            rows.append(
                row(
                    f"adapter-only refit, {name} rank {RANK} ({label}) vs merged full refit",
                    shape[f"{key}_s"] * 1e3,
                    unit="ms",
                    baseline=shape["full_s"] * 1e3,
                    baseline_name="full-weight refit of the same shape (bf16, merge not counted)",
                    target="<= 1 ms" if targeted and r["device"] != "cpu" else "",
                )
            )
            rows.append(
                row(
                    f"adapter-only refit bytes, {name} rank {RANK} ({label}) vs merged full refit",
                    float(shape[f"{key}_bytes"]),
                    unit="B",
                    baseline=float(shape["full_bytes"]),
                    baseline_name="full-weight refit bytes (bf16)",
                    target="<= 1% of baseline" if targeted else "",
                )
            )
    engine = r.get("vllm_cpu_engine")
    if engine is not None:
        rows.append(
            row(
                "vLLM CPU engine adapter refit (tiny Llama), ZMQ into its LoRA manager vs folder",
                engine["zmq_s"] * 1e3,
                unit="ms",
                baseline=engine["folder_s"] * 1e3,
                baseline_name="VllmAdapterVersions.publish(): PEFT folder + add_lora",
            )
        )
    multi = r.get("n_adapters")
    if multi is not None:
        rows.append(
            row(
                f"train tokens/s per adapter, {multi['num_adapters']} adapters on one base vs one",
                multi["per_adapter_tokens_per_s"],
                unit="tok/s",
                baseline=multi["single_tokens_per_s"],
                baseline_name="single-adapter worker, same model and batch",
                target=">= 0.9x",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes on CPU (smoke test)")
    parser.add_argument("--adapters", type=int, default=2, help="adapters on one base")
    parser.add_argument(
        "--part",
        choices=("all", "refit", "adapters", "vllm"),
        default="all",
        help="refit rows only, N-adapter training only, both (all), or vLLM's CPU engine only",
    )
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--json", default="bench_lora_adapters.json")
    parser.add_argument("--role", default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "receiver":
        run_receiver(args.spec)
        return 0
    if not args.small and args.part != "vllm" and not torch.cuda.is_available():
        parser.error("the 1.5B/7B rows need a CUDA device; use --small for the CPU smoke run")
    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    results: dict = {"device": "cpu" if device == "cpu" else torch.cuda.get_device_name()}
    shapes = SHAPE_NAMES[: 1 if args.small else 2]
    if args.part in ("all", "refit"):
        results["refits"] = [refit_shape(name, device, small=args.small) for name in shapes]
    batch, seq = args.batch or (2 if args.small else 4), args.seq or (32 if args.small else 1024)
    if args.part in ("all", "adapters"):
        results["n_adapters"] = n_adapters(
            small=args.small, num=args.adapters, batch=batch, seq=seq
        )
    if args.part == "vllm":
        results["vllm_cpu_engine"] = vllm_engine_refit()
    rows = summary_rows(results)
    for r in rows:
        ratio = f"{r['ratio']:.4f}x" if r["ratio"] is not None else ""
        print(f"{r['metric']:<92} {r['ours']:>14,.3f} {r['unit']:<5} {ratio:>10} {r['target']}")
    write_result(args.json, {"rows": rows, "settings": vars(args), **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

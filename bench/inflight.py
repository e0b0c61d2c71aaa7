"""In-flight refit benchmark: the longest gap between two consecutive decode steps of a running
generation while a refit happens, ours (stream into staging beside the decoding, swap between
two steps: `shell.refit.inflight.InflightWeights`) vs stop-the-world (the decode loop stops,
serves the whole refit in place with `HFWeightReceiver.receive()`, then goes on), on the same
process, the same model and the same sender.

Decode loop: the demo's HF sampler (`demo.inference.generate_tagged`: no KV cache, every step a
forward over the whole prefix, temperature 1); a refit starts every ``--every`` steps. Per refit
the row reports the longest step-to-step gap from the refit's start until the step after it was
served (the first refit of each mode is a warm-up, not counted), and for ours the swap alone;
throughput is the generated tokens per second over the whole run, beside a run with no
refit (the same steps).

The receiver shares this process with the sender (POSIX shared memory), so this runs on CPU; a
GPU run needs the receiver in a second process (CUDA IPC cannot open a handle of its own
process) and is not written yet.

    python -m bench.inflight --small    # tiny Qwen2 shape (seconds)
    python -m bench.inflight            # a ~0.1B shape (MEDIUM) on CPU (a minute)
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch

from bench.common import TINY, print_table, write_results
from bench.rows import row
from policyworker import HFWeightReceiver
from policyworker.demo import generate_tagged
from policyworker.shell.refit import InflightWeights, RefitSender
from policyworker.testing import tiny_model

# A ~0.1B shape whose refit (fp32, ~0.45 GB) is long next to one decode step on a CPU core.
MEDIUM = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _models(small: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    shape = TINY if small else MEDIUM
    serving = tiny_model("qwen2", seed=0, dtype=torch.float32, **shape).eval()
    trainer = tiny_model("qwen2", seed=1, dtype=torch.float32, **shape).eval()
    serving.config.use_cache = False
    return serving, trainer


class _Clock:
    """Step start times, and the step index at which each refit started and was served."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.refits: list[tuple[int, int]] = []
        self.swaps_s: list[float] = []  # ours: each swap's own time

    def gaps_per_refit(self) -> list[float]:
        gaps = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
        return [
            max(gaps[start : min(end + 1, len(gaps))], default=0.0) for start, end in self.refits
        ]


def _send(sender: RefitSender, box: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            box["report"] = sender.stream_weights_via_ipc_zmq(timeout_s=120)
        except Exception as exc:  # re-raised by the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _run(
    mode: str, serving, sender, prompts, steps: int, every: int, *, departed: int = 0
) -> tuple[_Clock, float]:
    clock = _Clock()
    info = sender.prepare_refit_info()
    address = sender.get_zmq_address()
    weights = receiver = None
    if mode == "inflight":
        weights = InflightWeights(serving, address=address, refit_info=info, timeout_s=120)
        weights.start()
    elif mode == "stop":
        receiver = HFWeightReceiver(serving, address=address, refit_info=info, timeout_s=120)
    if mode != "none" and not sender.wait_for_receivers(1, departed=departed, timeout_s=30):
        raise RuntimeError("the receiver did not connect to the sender within 30 s")
    pending: dict[str, Any] = {}

    def between(t: int) -> None:
        clock.starts.append(time.perf_counter())
        if mode == "none" or t == 0 or t % every:
            if weights is not None and pending and weights.pending:
                clock.refits.append((pending.pop("start"), t))
            return
        box: dict[str, Any] = {}
        thread = _send(sender, box)
        if receiver is not None:  # stop-the-world: this step waits for the whole refit
            receiver.receive()
            thread.join(120)
            clock.refits.append((t, t))
        else:
            pending["start"] = t
        if "error" in box:
            raise box["error"]

    start = time.perf_counter()
    try:
        sampled = generate_tagged(
            serving, prompts, steps, seed=0, weights=weights, between_steps=between
        )
        clock.swaps_s = [swap.seconds for swap in sampled.swaps]
    finally:
        seconds = time.perf_counter() - start
        for closeable in (weights, receiver):
            if closeable is not None:
                closeable.close()
    return clock, prompts.shape[0] * steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shape (a smoke run)")
    parser.add_argument("--steps", type=int, default=0, help="decode steps (default by shape)")
    parser.add_argument("--every", type=int, default=8, help="decode steps between refits")
    parser.add_argument("--rows", type=int, default=4, help="sequences decoded together")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="result path (bench/results/inflight.json)")
    args = parser.parse_args()
    steps = args.steps or (64 if args.small else 40)
    if steps < 3 * args.every:
        parser.error(
            f"--steps {steps} must be at least 3 * --every ({3 * args.every}): two refits "
            "are measured after a warm-up one"
        )
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    serving, trainer = _models(args.small)
    prompts = torch.randint(3, serving.config.vocab_size, (args.rows, 8))
    sender = RefitSender(lambda: trainer, torch.float32)
    generate_tagged(serving, prompts, 4, seed=0)  # warm-up: first calls allocate and dispatch
    try:
        _, plain_tps = _run("none", serving, sender, prompts, steps, args.every)
        ours, ours_tps = _run("inflight", serving, sender, prompts, steps, args.every)
        stop, stop_tps = _run("stop", serving, sender, prompts, steps, args.every, departed=1)
    finally:
        sender.close()
    # the first refit of each mode maps its staging files and warms its paths: not measured
    ours_gaps, stop_gaps = ours.gaps_per_refit()[1:], stop.gaps_per_refit()[1:]
    median_gap = statistics.median(
        b - a for a, b in zip(ours.starts, ours.starts[1:], strict=False)
    )
    rows = [
        row(
            "longest step gap per refit, max over refits",
            max(ours_gaps) * 1e3,
            unit="ms",
            baseline=max(stop_gaps) * 1e3,
            baseline_name="stop-the-world in-place refit, same process",
            limit=median_gap * 1e3,
            target="<= 0.1x",
        ),
        row(
            "longest step gap per refit, median over refits",
            statistics.median(ours_gaps) * 1e3,
            unit="ms",
            baseline=statistics.median(stop_gaps) * 1e3,
            baseline_name="stop-the-world in-place refit, same process",
            target="<= 0.1x",
        ),
        row(
            "swap between two decode steps (ours), max over refits",
            max(ours.swaps_s[1:]) * 1e3,
            unit="ms",
            baseline=max(stop_gaps) * 1e3,
            baseline_name="stop-the-world in-place refit, same process",
            target="<= 0.1x",
        ),
        row(
            f"decode tokens/s with a refit every {args.every} steps",
            ours_tps,
            unit="tok/s",
            baseline=plain_tps,
            baseline_name="the same decode with no refit",
            target=">= 95% of baseline",
        ),
        row(
            f"decode tokens/s with a refit every {args.every} steps, stop-the-world",
            stop_tps,
            unit="tok/s",
            baseline=plain_tps,
            baseline_name="the same decode with no refit",
        ),
    ]
    print_table("in-flight refit (CPU, one process)", rows)
    settings = vars(args) | {"steps": steps, "refits": len(ours_gaps)}
    write_results("inflight", {"rows": rows, "settings": settings, "device": "cpu"}, args.json)


if __name__ == "__main__":
    main()

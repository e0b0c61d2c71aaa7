"""In-flight refit benchmark, HF inference process: how long a running generation stalls per
refit, and the decode throughput with one refit every ``--every`` steps, ours (the transfer
streams into staging beside the decoding, `shell.refit.inflight.InflightWeights`; the swap runs
between two decode steps) vs pause -> refit -> resume (the decode loop stops, the whole refit is
received in place with `HFWeightReceiver.receive()`, then decoding goes on), in the same run,
the same inference process, the same model and the same sender.

Two processes, as in the demo: this one is the trainer (its model and `RefitSender`); a spawned
inference process decodes with the demo's HF sampler (`demo.inference.generate_tagged`: no KV
cache, every step a forward over the whole prefix, temperature 1) and asks for a refit every
``--every`` steps. On a GPU both hold the model on the same device and the refit goes over CUDA
IPC; on a CPU over shared memory. Three runs of the same steps: no refit (the reference),
ours, pause/resume; the first refit of each run is a warm-up, not counted.

Definitions (per refit, from the step it was asked for to the step that first ran on it):
- raw gap: the longest wall time between two consecutive tokens (host-visible: the sampler
  copies each step's logits to the host);
- stall: the longest excess of that gap over the no-refit run's gap at the same step (the
  prefix grows, so the reference is per step), i.e. what the refit added to the wait.
p99 is nearest-rank over the counted refits (with fewer than 100 refits: the largest).

Versions: every refit carries another final-norm constant (``_scale``), so consecutive
versions sample with different logprobs; after our run each token's logprob is recomputed
under the weights of the version it was tagged with and under every other version served, and a
token is wrong when another version explains it better and its own does not within tolerance.

    python -m bench.inflight --small    # tiny Qwen2 shape on CPU (seconds)
    python -m bench.inflight            # GPU: Qwen2.5-1.5B shape, bf16, random weights
                                        # CPU: a ~0.1B shape, fp32 (a minute)
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import time
from typing import Any

import torch

from bench.common import QWEN25_15B, TINY, device, print_table, write_results
from bench.rows import row
from policyworker import HFWeightReceiver
from policyworker.demo import generate_tagged
from policyworker.functional.dtypes import decode_refit_info, encode_refit_info
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
# |generated - recomputed| logprob accepted for a token's own version: fp32 recomputes within
# kernel rounding; bf16 rounds at ~1e-2 per op, and a whole-row forward differs from the
# sampler's prefix forwards in shape, so kernels may sum in another order.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
WAIT_S = 300.0  # any one wait between the two processes


def _scale(version: int) -> float:
    """The final-norm constant of the trainer's ``version``-th refit (neighbours differ)."""
    return 1.0 + 0.5 * (version % 4)


def _model(shape: dict[str, Any], dtype: torch.dtype, dev: torch.device) -> torch.nn.Module:
    # the same seed in both processes: the same weights, then one setup refit makes sure
    model = tiny_model("qwen2", seed=0, dtype=dtype, device=dev, **shape).eval()
    model.config.use_cache = False
    return model


def _set_version(model: torch.nn.Module, version: int) -> None:
    norm: Any = model.get_submodule("model.norm")
    with torch.no_grad():
        norm.weight.fill_(_scale(version))


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


# --- the inference process ------------------------------------------------------------------


class _Decoder:
    """The inference process's side: one model, one receiver per run, the step clock."""

    def __init__(self, conn: Any, spec: dict[str, Any]) -> None:
        self.conn, self.spec = conn, spec
        dtype, dev = getattr(torch, spec["dtype"]), torch.device(spec["device"])
        self.model = _model(spec["shape"], dtype, dev)
        self.info = decode_refit_info(spec["refit_info"])
        gen = torch.Generator().manual_seed(0)
        self.prompts = torch.randint(
            3, spec["shape"]["vocab_size"], (spec["rows"], 8), generator=gen
        )
        self.departed = 0
        generate_tagged(self.model, self.prompts, 4, seed=0)  # first calls allocate, dispatch

    def _expect(self, kind: str) -> Any:
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"the trainer sent no {kind!r} within {WAIT_S} s")
        message = self.conn.recv()
        if message[0] != kind:
            raise RuntimeError(f"expected {kind!r} from the trainer, got {message!r}")
        return message[1]

    def _connected(self) -> int:
        """Tell the trainer a new receiver is up; the version the model holds."""
        self.conn.send(("connect", self.departed))
        self.departed += 1
        return self._expect("go")

    def setup(self) -> None:
        """One refit in place before the runs: both sides hold the same version."""
        receiver = HFWeightReceiver(self.model, address=self.spec["address"], refit_info=self.info)
        try:
            self._connected()
            self.conn.send(("refit", None))
            receiver.receive()
        finally:
            receiver.close()

    def run(self, mode: str) -> dict[str, Any]:
        steps, every = self.spec["steps"], self.spec["every"]
        weights = receiver = None
        address = self.spec["address"]
        if mode == "inflight":
            weights = InflightWeights(
                self.model,
                address=address,
                refit_info=self.info,
                one_pass=self.spec["one_pass"],
            )
            weights.start()
        elif mode == "pause":
            receiver = HFWeightReceiver(self.model, address=address, refit_info=self.info)
        base = self._connected() if mode != "none" else None
        starts: list[float] = []
        asked: list[int] = []

        def between(t: int) -> None:
            starts.append(time.perf_counter())  # the previous token is on the host
            if mode == "none" or t == 0 or t % every:
                return
            asked.append(t)
            self.conn.send(("refit", None))
            if receiver is not None:  # pause -> refit -> resume: this step waits for all of it
                receiver.receive()

        begin = time.perf_counter()
        try:
            sampled = generate_tagged(
                self.model, self.prompts, steps, seed=0, weights=weights, between_steps=between
            )
            end = time.perf_counter()
            starts.append(end)
            if weights is not None:  # serve the last version too before this receiver goes
                weights.wait(received=len(asked), timeout_s=WAIT_S)
                weights.swap()
        finally:
            for closeable in (weights, receiver):
                if closeable is not None:
                    closeable.close()
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        lp = self.prompts.shape[1]
        tags = sampled.versions[0, lp:].tolist()
        if weights is None:  # served at the step that asked (pause) or never (none)
            served = list(asked)
        else:  # refit k first ran at the first step tagged k or later (a newer one overtook)
            served = [
                next((t for t, v in enumerate(tags) if v >= k), steps)
                for k in range(1, len(asked) + 1)
            ]
        result = {
            "gaps": gaps,
            "tokens_per_s": self.prompts.shape[0] * steps / (end - begin),
            "windows": [(a, s) for a, s in zip(asked, served, strict=True) if s < steps],
            "swaps_s": [swap.seconds for swap in sampled.swaps],
            "swap_mode": None if weights is None else weights.mode,
        }
        if weights is not None and base is not None:
            result["check"] = self._check(sampled, base, len(asked))
        return result

    @torch.no_grad()
    def _check(self, sampled: Any, base: int, refits: int) -> dict[str, Any]:
        """Each token's logprob recomputed under every version served in the run."""
        lp = self.prompts.shape[1]
        ids = torch.cat([self.prompts, sampled.tokens], dim=1)
        dev = next(self.model.parameters()).device
        tags = sampled.versions[:, lp:]
        got = sampled.generation_logprobs[:, lp:]
        served = sorted(set(tags.flatten().tolist()))
        per_version = {}
        for v in served:
            _set_version(self.model, base + v)
            logits = self.model(input_ids=ids.to(dev), use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, lp - 1 : -1], dim=-1).cpu()
            per_version[v] = logp.gather(-1, sampled.tokens[..., None])[..., 0]
        _set_version(self.model, base + refits)  # back to the newest
        tolerance = TOLERANCE[getattr(torch, self.spec["dtype"])]
        table = torch.stack([per_version[v] for v in served])  # [V, N, Lr]
        own = torch.zeros_like(got)
        for i, v in enumerate(served):
            own = torch.where(tags == v, table[i], own)
        own_err = (got - own).abs()
        best_err = (got[None] - table).abs().min(dim=0).values
        wrong = (own_err > tolerance) & (best_err < own_err)
        spread = table.max(dim=0).values - table.min(dim=0).values
        return {
            "wrong": int(wrong.sum()),
            "tokens": int(got.numel()),
            "versions": served,
            "max_own_err": float(own_err.max()),
            "distinguishable": float((spread > 2 * tolerance).float().mean()),
            "tolerance": tolerance,
        }


def _serve(conn: Any, spec: dict[str, Any]) -> None:
    """Body of the inference process: set up, run the three modes, report, exit."""
    torch.set_num_threads(spec["threads"])
    import transformers

    transformers.utils.logging.set_verbosity_error()
    try:
        decoder = _Decoder(conn, spec)
        decoder.setup()
        decoder.run("none")  # warm-up: the first full run pays allocations the others do not
        results = {mode: decoder.run(mode) for mode in ("none", "inflight", "pause")}
        conn.send(("done", results))
    except Exception as exc:  # reported to the trainer, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


# --- the trainer ----------------------------------------------------------------------------


def _drive(conn: Any, child: Any, trainer: torch.nn.Module, sender: RefitSender) -> dict:
    """Answer the inference process until it reports: connect, refit (stream the next
    version: another final-norm constant), done."""
    version = 0
    stream_ms: list[float] = []
    while True:
        if not conn.poll(WAIT_S):
            raise TimeoutError(f"the inference process said nothing for {WAIT_S} s")
        kind, payload = conn.recv()
        if kind == "connect":
            if not sender.wait_for_receivers(1, departed=payload, timeout_s=60):
                raise RuntimeError("the inference process's receiver did not connect in 60 s")
            conn.send(("go", version))
        elif kind == "refit":
            version += 1
            _set_version(trainer, version)
            t0 = time.perf_counter()
            sender.stream_weights_via_ipc_zmq(timeout_s=120)
            stream_ms.append((time.perf_counter() - t0) * 1e3)
        elif kind == "done":
            return {**payload, "stream_ms": stream_ms}
        else:
            child.join(10)
            raise RuntimeError(f"the inference process failed: {payload}")


def _per_refit(run: dict, reference: list[float]) -> tuple[list[float], list[float]]:
    """(raw gap, stall) per counted refit: the longest gap over its window, and the longest
    excess over the no-refit run's gap at the same step."""
    gaps = run["gaps"]
    raw, stall = [], []
    for asked, served in run["windows"][1:]:  # the first refit is a warm-up
        window = range(asked, min(served, len(gaps) - 1) + 1)
        raw.append(max(gaps[t] for t in window))
        stall.append(max(gaps[t] - reference[t] for t in window))
    return raw, stall


def _rows(results: dict, args: argparse.Namespace, steps: int) -> list[dict[str, Any]]:
    none, ours, pause = results["none"], results["inflight"], results["pause"]
    reference = none["gaps"]
    ours_raw, ours_stall = _per_refit(ours, reference)
    pause_raw, pause_stall = _per_refit(pause, reference)
    if not ours_raw or not pause_raw:
        msg = f"no refit counted (--steps {steps}, --every {args.every}); run more steps"
        raise RuntimeError(msg)
    normal_ms = statistics.median(reference) * 1e3
    every_s = args.every * statistics.mean(reference)
    pause_name = "pause -> refit in place -> resume, same process, same run"
    check = ours["check"]
    return [
        row(
            "p99 stall per refit (longest inter-token gap minus the no-refit run's gap at "
            "that step)",
            _p99(ours_stall) * 1e3,
            unit="ms",
            baseline=_p99(pause_stall) * 1e3,
            baseline_name=pause_name,
            limit=normal_ms,
            target="<= 0.1x",
        ),
        row(
            "median stall per refit (same definition)",
            statistics.median(ours_stall) * 1e3,
            unit="ms",
            baseline=statistics.median(pause_stall) * 1e3,
            baseline_name=pause_name,
            limit=normal_ms,
        ),
        row(
            "p99 longest raw inter-token gap per refit",
            _p99(ours_raw) * 1e3,
            unit="ms",
            baseline=_p99(pause_raw) * 1e3,
            baseline_name=pause_name,
            limit=normal_ms,
        ),
        row(
            "swap between two decode steps (ours), max over refits",
            max(ours["swaps_s"][1:] or ours["swaps_s"]) * 1e3,
            unit="ms",
            baseline=_p99(pause_raw) * 1e3,
            baseline_name=pause_name + " (p99 raw gap)",
        ),
        row(
            f"decode tokens/s, a refit every {args.every} steps (~{every_s:.2f} s), ours",
            ours["tokens_per_s"],
            unit="tok/s",
            baseline=none["tokens_per_s"],
            baseline_name="the same decode with no refit",
            target=">= 95% of baseline",
        ),
        row(
            f"decode tokens/s, a refit every {args.every} steps (~{every_s:.2f} s), pause/resume",
            pause["tokens_per_s"],
            unit="tok/s",
            baseline=none["tokens_per_s"],
            baseline_name="the same decode with no refit",
        ),
        row(
            "tokens attributed to the wrong version (logprobs recomputed per version), ours",
            check["wrong"],
            unit="tokens",
            limit=f"of {check['tokens']}; {check['distinguishable']:.0%} distinguishable",
            target="<= 0",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shape on CPU (a smoke run)")
    parser.add_argument("--steps", type=int, default=0, help="decode steps (default by shape)")
    parser.add_argument(
        "--every", type=int, default=0, help="steps between refits (default by shape)"
    )
    parser.add_argument("--rows", type=int, default=0, help="sequences decoded together")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--one-pass",
        choices=("auto", "on", "off"),
        default="auto",
        help="how ours stages: auto (one-pass into a spare arena on a GPU, staged on a CPU), "
        "on, off (InflightWeights' one_pass None / True / False)",
    )
    parser.add_argument("--json", default=None, help="result path (bench/results/inflight.json)")
    args = parser.parse_args()
    dev = torch.device("cpu") if args.small else device()
    gpu = dev.type == "cuda"
    shape = TINY if args.small else (QWEN25_15B if gpu else MEDIUM)
    dtype = torch.bfloat16 if gpu else torch.float32
    steps = args.steps or (64 if args.small else 240 if gpu else 40)
    args.every = args.every or (8 if args.small or not gpu else 20)
    args.rows = args.rows or (8 if gpu else 4)
    if steps < 3 * args.every:
        parser.error(
            f"--steps {steps} must be at least 3 * --every ({3 * args.every}): two refits "
            "are measured after a warm-up one"
        )
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    trainer = _model(shape, dtype, dev)
    sender = RefitSender(lambda: trainer, dtype, device=dev)
    spec = {
        "shape": shape,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(dev),
        "address": sender.get_zmq_address(),
        "refit_info": encode_refit_info(sender.prepare_refit_info()),
        "rows": args.rows,
        "steps": steps,
        "every": args.every,
        "threads": args.threads,
        "one_pass": {"auto": None, "on": True, "off": False}[args.one_pass],
    }
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_serve, args=(child_conn, spec), name="inflight-inference")
    child.start()
    try:
        results = _drive(conn, child, trainer, sender)
    finally:
        sender.close()
        child.join(30)
        if child.is_alive():
            child.terminate()
    rows = _rows(results, args, steps)
    where = torch.cuda.get_device_name(dev) if gpu else "cpu"
    print_table(f"in-flight refit, HF inference process ({where}, {spec['dtype']})", rows)
    settings = vars(args) | {
        "steps": steps,
        "shape": shape,
        "dtype": spec["dtype"],
        "refits_counted": len(results["inflight"]["windows"]) - 1,
        "stream_ms_median": statistics.median(results["stream_ms"]),
        "version_check": results["inflight"]["check"],
        "inflight_swap_mode": results["inflight"]["swap_mode"],
    }
    write_results("inflight", {"rows": rows, "settings": settings, "device": where}, args.json)


if __name__ == "__main__":
    main()

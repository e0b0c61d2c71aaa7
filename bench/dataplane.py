"""Data plane vs plain group calls: bytes through the driver and wall time per call.

Rows, per batch (tokens = rows x seq) and number of CPU ranks (a dp group of Ray actors), for
`get_logprobs` and `train` (NLL loss, one optimizer step):
- batch bytes through the driver: ours = the presharded call (the receipts sent to the ranks;
  the logprobs stay in TransferQueue, each rank returns None), baseline = the plain group call
  (the shards sent; for logprobs also the logprobs returned), as pickled sizes. `train`'s
  per-rank metrics dicts come back on both paths: their own row, without a target;
- wall time: ours = presharded (each rank fetches its rows from TransferQueue; logprobs are
  written back as `prev_logprobs`), baseline = the plain group call on the same rows. The four
  calls alternate within every repeat (medians), so a load change on a shared machine hits
  both sides alike.

The batch is put into TransferQueue by a Ray task (the rollout side), so the driver never holds
it for the presharded call; the plain call gets the same rows (same seed) on the driver. Targets
(issue text): driver bytes <= 1 % of the batch's bytes; wall time no worse than the plain call.

The model is always the tiny one on CPU ranks (the cost measured is the data path, not the
model). Usage: `python -m bench.dataplane` (2 and 4 ranks, 8k and 64k tokens) or `--small`
(2 ranks, 8k tokens); `--ranks` / `--tokens` / `--repeats` pick others.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import make_batch, print_table, save_random_model, write_results

FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")
SEQ = {8192: 512, 65536: 1024}


def _batch(rows: int, seq: int) -> dict[str, torch.Tensor]:
    return make_batch([seq] * rows, vocab=1024, seed=0)


def _put_remote(rows: int, seq: int, partition: str) -> Any:
    """A Ray task (the rollout side) that makes the batch and puts it; returns the receipt."""
    import ray

    @ray.remote(num_cpus=0)
    def put() -> Any:
        from policyworker.config import DataPlaneConfig
        from policyworker.shell.data_plane import build_client

        client = build_client(DataPlaneConfig(), bootstrap=False)
        data = _batch(rows, seq)
        keys = [f"{partition}-{i}" for i in range(rows)]
        return client.put_samples(keys, partition, {k: data[k] for k in FIELDS})

    return ray.get(put.remote(), timeout=300)


def _plain_bytes(group: Any, data: dict[str, torch.Tensor], result: Any, *, gbs: int | None) -> int:
    from policyworker.shell.ray import split_over_dp

    shards, _ = split_over_dp(data, dp_size=group.dp_size, batch_size=gbs)
    return sum(len(pickle.dumps(dict(s))) for s in shards) + len(pickle.dumps(dict(result)))


def _interleaved(calls: dict[str, Callable[[], Any]], *, repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls alternating within every repeat (after one
    warmup each), so a load change on a shared machine hits both sides alike."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _rows(call: str, label: str, bytes_: tuple[int, int], secs: tuple[float, float], batch: int):
    ours_bytes, plain_bytes = bytes_
    ours_s, plain_s = secs
    return [
        {
            "metric": f"{call} batch bytes through the driver, {label}",
            "ours": float(ours_bytes),
            "baseline": float(plain_bytes),
            "baseline_name": "the plain group call (shards out, results back)",
            "limit": 0.01 * batch,
            "ratio": ours_bytes / batch,
            "target": "<= 1% of the batch's bytes (limit column; ratio: ours / batch)",
            "unit": "B",
        },
        {
            "metric": f"{call} wall time, {label}",
            "ours": ours_s * 1e3,
            "baseline": plain_s * 1e3,
            "baseline_name": "the plain group call on the same rows",
            "ratio": ours_s / plain_s,
            "target": "<= 1.0x",
            "unit": "ms",
        },
    ]


def measure(path: str, *, ranks: int, tokens: int, repeats: int) -> list[dict[str, Any]]:
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell import ray as rdp
    from policyworker.shell.ray import RayWorkerGroup

    seq = SEQ.get(tokens, 512)
    rows = max(ranks, tokens // seq)
    cfg = {
        "model_name": path,
        "precision": "float32",
        "logprob_batch_size": max(1, rows // ranks),
        "train_global_batch_size": rows,
        "train_micro_batch_size": max(1, rows // ranks),
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6}},
    }
    data = _batch(rows, seq)
    batch_bytes = sum(t.nbytes for t in data.values())
    meta = _put_remote(rows, seq, f"bench-{ranks}-{tokens}")
    loss = NLLLoss()
    with RayWorkerGroup(cfg, num_workers=ranks, torch_threads=1, timeout_s=600.0) as group:
        rdp.setup_data_plane(group, {"enabled": True, "impl": "transfer_queue"})
        results: dict[str, Any] = {}

        def keep(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: results.__setitem__(name, fn())

        secs = _interleaved(
            {
                "lp_plain": keep("lp_plain", lambda: group.get_logprobs(data)),
                "lp_ours": keep("lp_ours", lambda: rdp.get_logprobs_presharded(group, meta)),
                "train_plain": keep("train_plain", lambda: group.train(data, loss)),
                "train_ours": keep("train_ours", lambda: rdp.train_presharded(group, meta, loss)),
            },
            repeats=repeats,
        )
        lp_receipts = rdp.rank_receipts(group, meta, batch_size=None)
        train_receipts = rdp.rank_receipts(group, meta, batch_size=rows)
        lp_plain = _plain_bytes(group, data, results["lp_plain"], gbs=None)
        train_shards = _plain_bytes(group, data, {}, gbs=rows) - len(pickle.dumps({}))
    # Every rank returns its result to the driver: None here for the presharded logprobs (they
    # stay in the data plane); for train, each rank's metrics dict, the same on both paths.
    lp_ours = sum(len(pickle.dumps(r)) for r in lp_receipts) + ranks * len(pickle.dumps(None))
    train_ours = sum(len(pickle.dumps(r)) for r in train_receipts)
    train_back = ranks * len(pickle.dumps(dict(results["train_ours"])))
    label = f"{rows}x{seq} ({tokens // 1024}k tokens), {ranks} CPU ranks"
    lp_secs = (secs["lp_ours"], secs["lp_plain"])
    train_secs = (secs["train_ours"], secs["train_plain"])
    return [
        *_rows("get_logprobs", label, (lp_ours, lp_plain), lp_secs, batch_bytes),
        *_rows("train", label, (train_ours, train_shards), train_secs, batch_bytes),
        {
            "metric": f"train results back to the driver (metrics; both paths), {label}",
            "ours": float(train_back),
            "baseline": float(train_back),
            "baseline_name": "the same per-rank metrics dicts",
            "ratio": train_back / batch_bytes,
            "target": "- (not bulk: does not grow with tokens)",
            "unit": "B",
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="smoke run: 2 ranks, 8k tokens")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="out", default=None, help="JSON path (default results/)")
    args = parser.parse_args()
    args.ranks = args.ranks or ([2] if args.small else [2, 4])
    args.tokens = args.tokens or ([8192] if args.small else [8192, 65536])
    torch.set_num_threads(1)

    import ray

    from policyworker.config import DataPlaneConfig
    from policyworker.shell.data_plane import build_client

    # TransferQueue's controller and storage unit hold a CPU each, beside the ranks.
    ray.init(
        address="local", num_cpus=max(args.ranks) + 2, include_dashboard=False, log_to_driver=False
    )
    client = build_client(DataPlaneConfig(), bootstrap=True)
    out: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            num_params = save_random_model(Path(tmp), small=True)
            for ranks in args.ranks:
                for tokens in args.tokens:
                    out += measure(tmp, ranks=ranks, tokens=tokens, repeats=args.repeats)
    finally:
        client.close()
        ray.shutdown()
    print_table(f"Data plane vs plain group calls, {num_params / 1e6:.2f}M params, CPU", out)
    write_results(
        "dataplane",
        {"device": "cpu", "settings": vars(args), "num_params": num_params, "rows": out},
        args.out,
    )


if __name__ == "__main__":
    main()

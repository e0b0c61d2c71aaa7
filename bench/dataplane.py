"""Data plane vs plain group calls: bytes through the driver and wall time per call.

Rows, per batch (tokens = rows x seq) and number of CPU ranks (a dp group of Ray actors):
- bytes through the driver for `get_logprobs`: ours = the presharded call (the receipts sent to
  the ranks; nothing comes back, the logprobs stay in TransferQueue), baseline = the plain group
  call (the shards sent, the logprobs returned), both as their pickled sizes;
- wall time of `get_logprobs`: ours = presharded (each rank fetches its rows from TransferQueue
  and writes `prev_logprobs` back), baseline = the plain group call on the same rows.

The batch is put into TransferQueue by a Ray task (the rollout side), so the driver never holds
it for the presharded call; the plain call gets the same rows (same seed) on the driver. Targets
(issue text): driver bytes <= 1 % of the batch's bytes; wall time no worse than the plain call.

The model is always the tiny one on CPU ranks (the cost measured is the data path, not the
model). Usage: `python -m bench.dataplane` (2 and 4 ranks, 8k and 64k tokens, about 6 minutes on
2 cores) or `--small` (2 ranks, 8k tokens); `--ranks` / `--tokens` pick others.
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import make_batch, print_table, save_random_model, timed, write_results

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


def _plain_bytes(group: Any, data: dict[str, torch.Tensor], result: Any) -> int:
    from policyworker.shell.ray import split_over_dp

    shards, _ = split_over_dp(data, dp_size=group.dp_size, batch_size=None)
    return sum(len(pickle.dumps(dict(s))) for s in shards) + len(pickle.dumps(dict(result)))


def measure(path: str, *, ranks: int, tokens: int, repeats: int) -> list[dict[str, Any]]:
    from policyworker.shell import ray as rdp
    from policyworker.shell.ray import RayWorkerGroup

    seq = SEQ.get(tokens, 512)
    rows = max(ranks, tokens // seq)
    cfg = {
        "model_name": path,
        "precision": "float32",
        "logprob_batch_size": max(1, rows // ranks),
        "train_global_batch_size": rows,
        "train_micro_batch_size": 1,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6}},
    }
    data = _batch(rows, seq)
    batch_bytes = sum(t.nbytes for t in data.values())
    meta = _put_remote(rows, seq, f"bench-{ranks}-{tokens}")
    with RayWorkerGroup(cfg, num_workers=ranks, torch_threads=1, timeout_s=600.0) as group:
        rdp.setup_data_plane(group, {"enabled": True, "impl": "transfer_queue"})
        plain_s, result = timed(lambda: group.get_logprobs(data), repeats=repeats)
        ours_s, _ = timed(lambda: rdp.get_logprobs_presharded(group, meta), repeats=repeats)
        receipts = rdp.rank_receipts(group, meta, batch_size=None)
    ours_bytes = sum(len(pickle.dumps(r)) for r in receipts)
    plain_bytes = _plain_bytes(group, data, result)
    label = f"{rows}x{seq} ({tokens // 1024}k tokens), {ranks} CPU ranks"
    return [
        {
            "metric": f"get_logprobs bytes through the driver, {label}",
            "ours": float(ours_bytes),
            "baseline": float(plain_bytes),
            "baseline_name": "the plain group call (shards out, logprobs back)",
            "limit": 0.01 * batch_bytes,
            "ratio": ours_bytes / plain_bytes,
            "target": "<= 1% of the batch's bytes (limit column)",
            "unit": "B",
        },
        {
            "metric": f"get_logprobs wall time, {label}",
            "ours": ours_s * 1e3,
            "baseline": plain_s * 1e3,
            "baseline_name": "the plain group call on the same rows",
            "ratio": ours_s / plain_s,
            "target": "<= 1.0x",
            "unit": "ms",
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

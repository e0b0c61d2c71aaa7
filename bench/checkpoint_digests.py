"""The digests' share of a sync save, for `bench.checkpoint`.

The same sync save timed three ways, interleaved, median of ``DIGEST_REPEATS``: with the digests
hashed while the files are written (the default), with a second pass over the written files
after the writes (the path it replaced: ``digests.HASH_WHILE_WRITING = False``), and with no
digests at all; share = (save - save without digests) / save. A module of its own (ten sync
saves: `bench.checkpoint`'s run is long already):

    python -m bench.checkpoint_digests --repeats 2     # qwen2-1.5b on CUDA (about 2 minutes)
    python -m bench.checkpoint_digests --small          # CPU smoke run, tiny shape (seconds)
    python -m bench.checkpoint_digests --shape medium --dir /dev/shm   # CPU on tmpfs
"""

import argparse
import contextlib
import json
import pathlib
import pkgutil
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any
from unittest import mock

import torch

from bench.rows import write_result
from policyworker.shell import checkpoint as ck

DIGEST_REPEATS = 3
_DIGESTS = "policyworker.shell.checkpoint.digests"


def _no_digests(folders: object, *, algorithm: object = None) -> None:
    return None


# per mode, the module attributes patched for its saves; the default runs last, so the folders
# stay a complete checkpoint for what the caller does next (a load)
_MODES: dict[str, dict[str, Any]] = {
    "none": {"HASH_WHILE_WRITING": False, "write_digests_of": _no_digests},
    "second_pass": {"HASH_WHILE_WRITING": False},
    "while_writing": {},
}


def digest_share(
    worker: Any, weights: pathlib.Path, optim: pathlib.Path, *, repeats: int = DIGEST_REPEATS
) -> dict[str, Any]:
    """Time `worker`'s sync save into `weights` / `optim` (both replaced) in each mode."""
    times: dict[str, list[float]] = {mode: [] for mode in _MODES}
    for _ in range(repeats):
        for mode, patches in _MODES.items():
            shutil.rmtree(weights, ignore_errors=True)
            shutil.rmtree(optim, ignore_errors=True)
            with contextlib.ExitStack() as stack:
                for name, value in patches.items():
                    stack.enter_context(mock.patch(f"{_DIGESTS}.{name}", value))
                t0 = time.perf_counter()
                ck.save_checkpoint(worker, weights, optim, is_final_checkpoint=True)
                times[mode].append(time.perf_counter() - t0)
    none, second, writing = (statistics.median(times[mode]) for mode in _MODES)
    return {
        "digest_algorithm": pkgutil.resolve_name(f"{_DIGESTS}.save_algorithm")(),
        "sync_save_no_digests_s": none,
        "sync_save_digests_second_pass_s": second,
        "sync_save_digests_while_writing_s": writing,
        "digest_share_of_sync_save": (writing - none) / writing,
        "digest_share_of_sync_save_second_pass": (second - none) / second,
    }


def main(argv: list[str] | None = None) -> int:
    import bench.checkpoint as bench_checkpoint
    from bench.checkpoint_report import digest_row

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shape on CPU (smoke run)")
    parser.add_argument("--shape", choices=sorted(bench_checkpoint.SHAPES), default=None)
    parser.add_argument("--dir", default=None, help="folder to save in (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=DIGEST_REPEATS)
    parser.add_argument("--json", default="bench_checkpoint_digests.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape_name = args.shape or ("small" if args.small else "qwen2-1.5b")
    root = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-digests-", dir=args.dir))
    try:
        worker = bench_checkpoint._Worker(bench_checkpoint.SHAPES[shape_name], device, seed=0)
        weights, optim = root / "weights", root / "optimizer"
        ck.save_checkpoint(worker, weights, optim, is_final_checkpoint=True)  # warm-up
        files = [p for r in (weights, optim) for p in r.rglob("*") if p.is_file()]
        results = {
            "shape": shape_name,
            "device": str(device),
            "bytes": sum(f.stat().st_size for f in files),
            **digest_share(worker, weights, optim, repeats=args.repeats),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=1))
    write_result(args.json, {"rows": [digest_row(results)], "settings": vars(args), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

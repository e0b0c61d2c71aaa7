"""Checkpoint benchmark: save/load GB/s (weights + AdamW state), time the training loop is blocked.

Model: a randomly initialised Qwen2 with the 1.5B shape (hidden 1536, 28 layers, vocab 151936,
tied embeddings), fp32 master weights on the device, AdamW state initialised by one step. One
process (`policyworker.shell.checkpoint` on a worker-shaped object; no reference weights).

Reported, all against the same folder on the same disk in the same run:
- raw disk write: the same byte count written with `os.write` in 64 MiB blocks, then fsync;
  and again as `WRITER_THREADS` files written side by side (the disk with as many requests in
  flight as a save has: the tighter ceiling);
- sync save (`is_final_checkpoint=True`): seconds blocked and GB/s, with the default
  `checkpoint.layout.WRITER_THREADS` writer threads and again with one (the single-writer path
  this replaced: its baseline in the same run);
- async save, twice in a row (each finalized before the next, as a training loop that saves
  every N steps): seconds until `save_checkpoint` returns (staging: the loop is blocked this
  long; the first save also page-locks the staging buffers the second one reuses) and seconds
  until `finalize_async_save` returns (files fsynced and renamed into place);
- sync save right after them, with their staging buffers kept (the final save of a loop that
  saved asynchronously: a copy into the pinned buffers, then writes from host memory);
- load: `load_checkpoint` into a fresh model and optimizer after the files were evicted from the
  page cache (`posix_fadvise(DONTNEED)`), GB/s; the loaded weights are checked bit-exact;
- raw disk read: the same files, evicted the same way, read with `os.read` in 64 MiB blocks,
  and again as 64 MiB `os.pread` blocks from `WRITER_THREADS` threads (the load's physical
  baselines: one stream, and as many requests in flight as a load has);
- sync save of the weights alone (no optimizer), and of the optimizer alone (its DCP job, as the
  sync save runs it): the sync save's split between the HF weights and the optimizer (both
  copied out through the writer threads' bounce buffers), and whether the two slow each other
  down when side by side; the optimizer alone again with DCP's own copies (each writer thread
  calls `tensor.cpu()`: the path before the save planner, its baseline);
- with `--load-phases`, load phases, each timed alone (the files evicted before each cold
  phase): digest
  verification of every folder (cold), the HF weights read into staging (cold, then warm), the
  optimizer read into staging (DCP, no digest check; cold, then warm) and the commits that copy
  the staged values into the model and optimizer. `load_checkpoint` overlaps the verification
  with the reads, so its time is about max(verify, reads) + commit, not their sum.

    python -m bench.checkpoint            # on a GPU: prints a table, writes bench_checkpoint.json
    python -m bench.checkpoint --small    # CPU smoke run on a tiny shape (seconds)
    python -m bench.checkpoint --skip-load   # saves only: no digest timing, no cold load
    python -m bench.checkpoint --load-phases # also each load phase alone (slower: 1.5B > 3 min)

The async saves run first and the JSON is rewritten after each phase, so a run cut short keeps
what it measured.
"""

import argparse
import os
import pathlib
import pkgutil
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from unittest import mock

import torch

from bench.checkpoint_report import print_results, summary_rows
from bench.common import QWEN25_15B, TINY
from bench.rows import write_result
from policyworker.shell import checkpoint as ck
from policyworker.shell.checkpoint import on_threads
from policyworker.shell.parallel import ParallelContext
from policyworker.testing import tiny_model

# Two baselines are the paths the library replaced, reached by patching the one setting each
# change added (no public knob: they exist for these rows only). A move of either module fails
# the row loudly at the patch, not silently.
_WRITER_THREADS = "policyworker.shell.checkpoint.layout.WRITER_THREADS"
_BOUNCED = "policyworker.shell.checkpoint.bounce.bounced"


def _writer_threads() -> int:
    """Threads per rank that write a save's files (the library's setting, read at each save)."""
    return int(pkgutil.resolve_name(_WRITER_THREADS))


SHAPE_1P5B, SHAPE_SMALL = QWEN25_15B, TINY  # bench/common.py's shapes
# ~0.36B params (4.3 GB with AdamW): the disk path at a size a CPU host holds in memory.
SHAPE_MEDIUM = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=65536,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
SHAPES = {"small": SHAPE_SMALL, "medium": SHAPE_MEDIUM, "qwen2-1.5b": SHAPE_1P5B}
BLOCK = 64 * 2**20


class _Worker:
    """The attributes the checkpoint functions read."""

    def __init__(self, shape: dict, device: torch.device, seed: int) -> None:
        self.model = tiny_model("qwen2", seed=seed, device=device, **shape)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        for p in self.model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tokenizer, self.cfg, self.reference_state = None, None, None
        self.saver = ck.AsyncSaver()
        self.parallel = ParallelContext.single(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _files(*roots: pathlib.Path) -> list[pathlib.Path]:
    return [p for r in roots for p in r.rglob("*") if p.is_file()]


def _evict(files: list[pathlib.Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_write(path: pathlib.Path, nbytes: int) -> float:
    block = os.urandom(BLOCK)
    t0 = time.perf_counter()
    _write_and_fsync(path, nbytes, block)
    seconds = time.perf_counter() - t0
    _evict([path])
    path.unlink()
    return seconds


def _async_save(worker: _Worker, weights: pathlib.Path, optim: pathlib.Path) -> tuple[float, float]:
    """(seconds blocked, seconds until finalized) of one async save into fresh folders."""
    shutil.rmtree(weights, ignore_errors=True)
    shutil.rmtree(optim, ignore_errors=True)
    t0 = time.perf_counter()
    ck.save_checkpoint(worker, weights, optim)
    blocked_s = time.perf_counter() - t0
    ck.finalize_async_save(worker)
    return blocked_s, time.perf_counter() - t0


def _raw_read(files: list[pathlib.Path]) -> float:
    _evict(files)
    t0 = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, BLOCK):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _raw_parallel_write(root: pathlib.Path, nbytes: int, streams: int) -> float:
    """The same byte count as `streams` files written side by side (64 MiB `os.write` blocks,
    then fsync each): the disk's write speed with as many requests in flight as a save has."""
    paths = [root / f"raw-{i}.bin" for i in range(streams)]
    share, block = -(-nbytes // streams), os.urandom(BLOCK)
    t0 = time.perf_counter()
    on_threads(
        lambda path: _write_and_fsync(path, share, block), paths, threads=streams, name="raw-write"
    )
    seconds = time.perf_counter() - t0
    _evict(paths)
    for path in paths:
        path.unlink()
    return seconds


def _write_and_fsync(path: pathlib.Path, nbytes: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(block)[: min(left, BLOCK)])
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_parallel_read(files: list[pathlib.Path], streams: int) -> float:
    """The files, evicted, read as 64 MiB `os.pread` blocks by `streams` threads at once: the
    disk's read speed with as many requests in flight as a load has."""
    _evict(files)
    blocks = [(f, offset) for f in files for offset in range(0, f.stat().st_size, BLOCK)]

    def read(block: tuple[pathlib.Path, int]) -> None:
        fd = os.open(block[0], os.O_RDONLY)
        try:
            os.pread(fd, BLOCK, block[1])
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    on_threads(read, blocks, threads=streams, name="raw-read")
    return time.perf_counter() - t0


def _one_writer_sync_save(worker: _Worker, root: pathlib.Path) -> float:
    """Seconds of a sync save written by one thread (the path the writer pool replaced)."""
    weights, optim = root / "one-writer-weights", root / "one-writer-optimizer"
    with mock.patch(_WRITER_THREADS, 1):
        t0 = time.perf_counter()
        ck.save_checkpoint(worker, weights, optim, is_final_checkpoint=True)
        seconds = time.perf_counter() - t0
    _evict(_files(weights, optim))
    shutil.rmtree(weights)
    shutil.rmtree(optim)
    return seconds


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn()
    _sync(device)
    return time.perf_counter() - t0, value


def _load_phases(
    shape: dict,
    device: torch.device,
    weights: pathlib.Path,
    optim: pathlib.Path,
    files: list[pathlib.Path],
) -> dict:
    """Seconds of each part of a load, each run alone (see the module docstring)."""
    fresh = _Worker(shape, device, seed=2)
    _sync(device)
    folders = [weights / ck.MODEL_DIR, optim / ck.OPTIM_DIR]
    out = {}

    def verify() -> None:
        for folder in folders:
            ck.verify_digests(folder)

    def read_hf() -> object:
        return ck.load_hf_weights(fresh.model, folders[0], parallel=fresh.parallel)

    def read_optimizer() -> object:
        return ck.load_optimizer(
            fresh.optimizer,
            fresh.scheduler,
            optim,
            model=fresh.model,
            parallel=fresh.parallel,
            verify=False,
        )

    for name, fn in (("verify", verify), ("hf_read", read_hf), ("optimizer_read", read_optimizer)):
        _evict(files)
        out[f"phase_{name}_cold_s"], _ = _timed(fn, device)
    out["phase_hf_read_warm_s"], commit_hf = _timed(read_hf, device)
    out["phase_optimizer_read_warm_s"], commit_optimizer = _timed(read_optimizer, device)
    out["phase_commit_s"], _ = _timed(lambda: (commit_hf(), commit_optimizer()), device)  # type: ignore[operator]
    return out


def run(
    shape: dict,
    device: torch.device,
    root: pathlib.Path,
    *,
    skip_load: bool = False,
    load_phases: bool = False,
    report: Callable[[dict], None] = lambda _: None,
) -> dict:
    worker = _Worker(shape, device, seed=0)
    _sync(device)
    weights, optim = root / "weights", root / "optimizer"
    out: dict = {"device": str(device), "torch": torch.__version__}
    first_blocked_s, first_total_s = _async_save(worker, weights, optim)
    files = _files(weights, optim)
    nbytes = sum(f.stat().st_size for f in files)
    gb = nbytes / 1e9
    out |= {
        "bytes": nbytes,
        "num_files": len(files),
        "async_first_blocked_s": first_blocked_s,
        "async_first_total_s": first_total_s,
        "staging_bytes": worker.saver.staging.nbytes,
    }
    report(out)
    async_blocked_s, async_total_s = _async_save(worker, weights, optim)
    out |= {
        "async_blocked_s": async_blocked_s,
        "async_total_s": async_total_s,
        "async_save_GBps": gb / async_total_s,
        "async_blocked_GBps": gb / async_blocked_s,
    }
    report(out)
    shutil.rmtree(weights)  # as before every timed save: deleting the last one is not timed
    shutil.rmtree(optim)
    t0 = time.perf_counter()
    ck.save_checkpoint(worker, weights, optim, is_final_checkpoint=True)
    staged_sync_s = time.perf_counter() - t0
    out |= {"sync_save_staged_s": staged_sync_s, "sync_save_staged_GBps": gb / staged_sync_s}
    report(out)
    worker.saver.release_staging()
    shutil.rmtree(weights)
    shutil.rmtree(optim)
    t0 = time.perf_counter()
    ck.save_checkpoint(worker, weights, optim, is_final_checkpoint=True)
    sync_s = time.perf_counter() - t0
    out |= {
        "sync_save_s": sync_s,
        "sync_save_GBps": gb / sync_s,
        "async_blocked_share_of_sync": async_blocked_s / sync_s,
        "async_first_blocked_share_of_sync": first_blocked_s / sync_s,
        "writer_threads": _writer_threads(),
    }
    report(out)
    out |= _sync_weights_only(worker, root, device)  # the sync save's split: weights vs optimizer
    out |= _sync_optimizer_only(worker, root, device)
    out |= _sync_optimizer_only(worker, root, device, dcp_copies=True)
    report(out)
    one_writer_s = _one_writer_sync_save(worker, root)
    out |= {"sync_save_one_writer_s": one_writer_s, "sync_save_one_writer_GBps": gb / one_writer_s}
    report(out)
    raw_s = _raw_write(root / "raw.bin", nbytes)
    out |= {"raw_write_s": raw_s, "raw_write_GBps": gb / raw_s}
    streams = _writer_threads()
    raw_parallel_s = _raw_parallel_write(root, nbytes, streams)
    out |= {
        "raw_streams": streams,
        "raw_write_parallel_s": raw_parallel_s,
        "raw_write_parallel_GBps": gb / raw_parallel_s,
    }
    report(out)
    if skip_load:
        return out
    # A second pass over the saved files alone (warm page cache, as it ran in the save right
    # after the writes before the writers hashed what they write): the cost hashing while
    # writing removed. What is left of it: `python -m bench.checkpoint_digests`.
    folders = [weights / ck.MODEL_DIR, optim / ck.OPTIM_DIR]
    t0 = time.perf_counter()
    for folder in folders:
        ck.write_digests(folder)
    digest_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for folder in folders:
        ck.verify_digests(folder)
    verify_s = time.perf_counter() - t0
    raw_read_s = _raw_read(files)
    raw_read_parallel_s = _raw_parallel_read(files, _writer_threads())
    _evict(files)
    fresh = _Worker(shape, device, seed=1)
    _sync(device)
    t0 = time.perf_counter()
    ck.load_checkpoint(fresh, weights, optim)
    _sync(device)
    load_s = time.perf_counter() - t0
    exact = all(
        torch.equal(a, b)
        for a, b in zip(
            worker.model.state_dict().values(), fresh.model.state_dict().values(), strict=True
        )
    )
    del fresh
    out |= {
        "load_s": load_s,
        "load_GBps": gb / load_s,
        "raw_read_s": raw_read_s,
        "raw_read_GBps": gb / raw_read_s,
        "raw_read_parallel_s": raw_read_parallel_s,
        "raw_read_parallel_GBps": gb / raw_read_parallel_s,
        "load_exact": exact,
        "digest_second_pass_s": digest_s,
        "digest_second_pass_share_of_sync_save": digest_s / sync_s,
        "verify_s": verify_s,
    }
    report(out)
    if load_phases:
        out |= _load_phases(shape, device, weights, optim, files)
    return out


def _sync_weights_only(worker: _Worker, root: pathlib.Path, device: torch.device) -> dict:
    """A sync save of the weights alone (no optimizer folder): with the full sync save, where
    its time goes (HF weights through the bounce buffers vs the optimizer through DCP)."""
    return _save_part(
        "weights",
        root / "weights-only",
        lambda folder: ck.save_checkpoint(worker, folder, None, is_final_checkpoint=True),
        device,
    )


def _sync_optimizer_only(
    worker: _Worker, root: pathlib.Path, device: torch.device, *, dcp_copies: bool = False
) -> dict:
    """The sync save's optimizer job alone (DCP, the device state copied out as it is written),
    timed from staging to the last fsync: with the weights-only row, where a sync save's time goes.

    `dcp_copies`: DCP's writer threads copy each device tensor themselves (`tensor.cpu()`), as
    before the save planner copied through their bounce buffers: that change's baseline."""

    def save(folder: pathlib.Path) -> None:
        ck.save_optimizer(
            worker.model,
            worker.optimizer,
            worker.scheduler,
            folder,
            parallel=worker.parallel,
            group=None,
            meta={},
            copy_sources=False,
        )()

    if not dcp_copies:
        return _save_part("optimizer", root / "optimizer-only", save, device)
    with mock.patch(_BOUNCED, lambda tensor: False):
        return _save_part("optimizer_dcp_copies", root / "optimizer-only", save, device)


def _save_part(
    part: str,
    folder: pathlib.Path,
    save: Callable[[pathlib.Path], object],
    device: torch.device,
) -> dict:
    """Seconds and bytes of one part of a sync save written into `folder` (removed after)."""
    seconds, _ = _timed(lambda: save(folder), device)
    files = _files(folder)
    nbytes = sum(f.stat().st_size for f in files)
    _evict(files)
    shutil.rmtree(folder)
    return {f"sync_save_{part}_only_s": seconds, f"sync_save_{part}_only_bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shape on CPU (smoke run)")
    parser.add_argument(
        "--dir", default=None, help="folder to write checkpoints in (default: a temp dir)"
    )
    parser.add_argument(
        "--json", default="bench_checkpoint.json", help="where to write the results"
    )
    parser.add_argument(
        "--skip-load", action="store_true", help="saves only (no digest timing, no cold load)"
    )
    parser.add_argument(
        "--load-phases",
        action="store_true",
        help="after the load, time its phases one by one (several more passes over the files)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="model shape (default: qwen2-1.5b; small with --small); medium = 0.36B params, "
        "for measuring the disk path on a CPU host",
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    root = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    shape_name = args.shape or ("small" if args.small else "qwen2-1.5b")

    def report(partial: dict) -> None:  # what a run cut short leaves: no rows yet
        payload = {**partial, "shape": shape_name, "partial": True}
        write_result(args.json, {"rows": [], "settings": vars(args), **payload})

    try:
        results = run(
            SHAPES[shape_name],
            device,
            root,
            skip_load=args.skip_load,
            load_phases=args.load_phases,
            report=report,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["shape"] = shape_name
    settings = {**vars(args), "shape": shape_name}
    print_results(results)
    write_result(args.json, {"rows": summary_rows(results), "settings": settings, **results})
    return 0 if results.get("load_exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())

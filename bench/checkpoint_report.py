"""What a checkpoint run's results say: the text table it prints and the schema rows it writes
(save and load throughput against the raw disk: one stream as the baseline, as many streams as
the writer threads as the limit; the async save's blocked time against a sync save)."""

from __future__ import annotations

from typing import Any

from bench.rows import row

__all__ = ["print_results", "summary_rows"]

_RULE = ">= 80% of baseline"


def summary_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The row schema of `bench.checkpoint.run`'s results."""
    disk, write_limit = r["raw_write_GBps"], r.get("raw_write_parallel_GBps", r["raw_write_GBps"])
    rows = [
        row(
            metric,
            gbps,
            unit="GB/s",
            baseline=disk,
            baseline_name="raw disk write + fsync, one stream",
            limit=write_limit,
            target=_RULE,
        )
        for metric, gbps in (
            ("sync save vs raw disk write", r["sync_save_GBps"]),
            (
                "sync save after an async one (staging kept) vs raw disk write",
                r["sync_save_staged_GBps"],
            ),
        )
    ]
    rows.append(
        row(
            "async save: time training is blocked vs sync save",
            r["async_blocked_s"],
            unit="s",
            baseline=r["sync_save_s"],
            baseline_name="a sync save of the same state",
            target="<= 10% of baseline",
        )
    )
    ours_s, dcp_s = r["sync_save_optimizer_only_s"], r["sync_save_optimizer_dcp_copies_only_s"]
    rows.append(
        row(
            "sync save of the optimizer alone: bounce buffers vs DCP's own .cpu()",
            r["sync_save_optimizer_only_bytes"] / 1e9 / ours_s,
            unit="GB/s",
            baseline=r["sync_save_optimizer_dcp_copies_only_bytes"] / 1e9 / dcp_s,
            baseline_name="DCP's writer threads copying each device tensor (tensor.cpu())",
            limit=write_limit,
            ratio=dcp_s / ours_s,
        )
    )
    rows.append(
        row(
            "sync save, all writer threads vs one writer",
            r["sync_save_GBps"],
            unit="GB/s",
            baseline=r["sync_save_one_writer_GBps"],
            baseline_name="the same save written by one thread",
            limit=write_limit,
        )
    )
    if "digest_share_of_sync_save" in r:  # bench.checkpoint_digests' figures
        rows.append(digest_row(r))
    if "load_GBps" in r:  # absent with --skip-load
        rows += [
            row(
                "load (cold page cache) vs raw disk read",
                r["load_GBps"],
                unit="GB/s",
                baseline=r["raw_read_GBps"],
                baseline_name="raw disk read, one stream, cold cache",
                limit=r["raw_read_parallel_GBps"],
                target=_RULE,
            ),
            row("load bit-exact (1 = yes)", float(bool(r["load_exact"]))),
        ]
    return rows


def digest_row(r: dict[str, Any]) -> dict[str, Any]:
    """The digests' share of a sync save (`bench.checkpoint_digests`), beside the second pass."""
    return row(
        "digests' share of a sync save, hashed while written (vs the same save without)",
        r["digest_share_of_sync_save"],
        baseline=r["digest_share_of_sync_save_second_pass"],
        baseline_name="a second pass over the written files (the path it replaced)",
        target="< 0.05",
    )


def print_results(results: dict[str, Any]) -> None:
    """The run's figures as a text table (seconds and GB/s per step), then its verdicts."""
    print(
        f"checkpoint ({results['shape']}, {results['bytes'] / 1e9:.2f} GB weights + AdamW, "
        f"{results['num_files']} files, {results['device']})"
    )
    nan = float("nan")
    rows = [
        ("raw disk write + fsync", results["raw_write_s"], results["raw_write_GBps"]),
        (
            f"  {results['raw_streams']} files side by side",
            results["raw_write_parallel_s"],
            results["raw_write_parallel_GBps"],
        ),
        (
            f"sync save, {results['writer_threads']} writers",
            results["sync_save_s"],
            results["sync_save_GBps"],
        ),
        (
            f"  of it: weights only ({results['sync_save_weights_only_bytes'] / 1e9:.1f} GB)",
            results["sync_save_weights_only_s"],
            results["sync_save_weights_only_bytes"] / 1e9 / results["sync_save_weights_only_s"],
        ),
        (
            f"  of it: optimizer only ({results['sync_save_optimizer_only_bytes'] / 1e9:.1f} GB)",
            results["sync_save_optimizer_only_s"],
            results["sync_save_optimizer_only_bytes"] / 1e9 / results["sync_save_optimizer_only_s"],
        ),
        (
            "    DCP's own .cpu() (baseline)",
            results["sync_save_optimizer_dcp_copies_only_s"],
            results["sync_save_optimizer_dcp_copies_only_bytes"]
            / 1e9
            / results["sync_save_optimizer_dcp_copies_only_s"],
        ),
        (
            "sync save, after async (staged)",
            results["sync_save_staged_s"],
            results["sync_save_staged_GBps"],
        ),
        (
            "sync save, 1 writer (baseline)",
            results["sync_save_one_writer_s"],
            results["sync_save_one_writer_GBps"],
        ),
        ("async save 1: blocked (pins)", results["async_first_blocked_s"], nan),
        ("async save 2: blocked (reuses)", results["async_blocked_s"], nan),
        ("async save 2: until finalized", results["async_total_s"], results["async_save_GBps"]),
    ]
    if "load_s" in results:
        rows.append(("raw disk read (cold cache)", results["raw_read_s"], results["raw_read_GBps"]))
        rows.append(
            (
                f"  {results['raw_streams']} streams",
                results["raw_read_parallel_s"],
                results["raw_read_parallel_GBps"],
            )
        )
        rows.append(("load (cold page cache)", results["load_s"], results["load_GBps"]))
        rows += [
            (f"  phase: {key[len('phase_') : -len('_s')]}", results[key], nan)
            for key in results
            if key.startswith("phase_")
        ]
    print(f"{'':32s} {'seconds':>9s} {'GB/s':>7s}")
    for name, seconds, gbps in rows:
        print(f"{name:32s} {seconds:9.3f} {gbps:7.2f}")
    print(
        f"async blocked / sync save: {100 * results['async_blocked_share_of_sync']:.1f} % "
        f"(first save {100 * results['async_first_blocked_share_of_sync']:.1f} %; target <= 10 %)"
        f"; staging buffers {results['staging_bytes'] / 1e9:.2f} GB"
    )
    if "load_s" in results:
        print(f"load bit-exact: {results['load_exact']}")
        print(
            f"per-file digests, a second pass alone: {results['digest_second_pass_s']:.3f} s "
            f"({100 * results['digest_second_pass_share_of_sync_save']:.1f} % of the sync save);"
            f" verify at load {results['verify_s']:.3f} s"
        )
    if "digest_share_of_sync_save" in results:
        share = results["digest_share_of_sync_save"]
        print(
            f"digests ({results['digest_algorithm']}) share of a sync save (vs the same save "
            f"without digests, "
            f"{results['sync_save_no_digests_s']:.3f} s): hashed while written "
            f"{100 * share:.1f} % ({results['sync_save_digests_while_writing_s']:.3f} s; target "
            f"< 5 %: {'met' if share < 0.05 else 'missed'}), second pass "
            f"{100 * results['digest_share_of_sync_save_second_pass']:.1f} % "
            f"({results['sync_save_digests_second_pass_s']:.3f} s)"
        )

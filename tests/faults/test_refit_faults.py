"""Refit faults of issues 18 (items 1, 7, 8, 9, 10, 11) and 21 (items 1-3), one test each.

Scenarios live in ``scenarios.py``; the ones whose fault can kill a process (SIGBUS, libzmq
aborts) run in a fresh process, so a regression fails its test instead of the whole session.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from tests.faults.conftest import assert_all_ok, run_apart, run_here

pytestmark = pytest.mark.faults


# ------------------------------------------------------------------------- 21.1 grad mode


@pytest.mark.parametrize("path", ["zmq", "sglang"])
def test_a_refit_failing_midway_leaves_grad_mode_on(path):
    assert_all_ok(run_here(f"grad_mode_{path}", 2), 2)


def test_a_collective_refit_whose_peer_is_sigkilled_leaves_grad_mode_on():
    assert_all_ok(run_here("grad_mode_collective", 1), 1)


# ------------------------------------------------------------------------- 21.2 / 21.3 / 18.11


def test_close_from_another_thread_ends_a_waiting_receive_with_a_closed_error():
    assert_all_ok(run_apart("close_while_receiving", 4), 4)


def test_a_failed_construction_leaves_no_zmq_socket_context_or_folder():
    assert_all_ok(run_here("failed_construction", 1), 1)


def test_a_sender_and_receiver_dropped_unclosed_in_a_cycle_are_freed_without_a_hang():
    # apart: before the fix the garbage collector blocked for good (the process is killed)
    assert_all_ok(run_apart("dropped_in_a_cycle", 2, timeout_s=60), 2)


def test_infinite_timeouts_and_long_socket_paths_fail_at_the_call_with_a_value_error():
    assert_all_ok(run_here("unbounded_and_long", 1), 1)


def test_a_killed_senders_staging_files_and_socket_folder_go_at_the_next_start():
    assert_all_ok(run_here("killed_sender_leftovers", 1), 1)


def test_a_shut_down_worker_refuses_to_train_or_open_a_refit_address():
    assert_all_ok(run_here("shut_down_worker", 1), 1)


# ------------------------------------------------------------------ 18.7 / 18.8 / 18.9 / 18.10


def test_two_threads_refitting_one_sender_one_is_refused_clearly():
    assert_all_ok(run_apart("two_threads_one_sender", 3), 3)


def test_a_refit_starting_as_the_receiver_retries_after_an_idle_timeout_is_not_lost():
    assert_all_ok(run_apart("retry_after_idle_timeout", 7), 7)


def test_two_receivers_on_one_address_are_refused_before_begin():
    assert_all_ok(run_apart("two_receivers_one_address", 2), 2)


def test_oversized_frames_are_dropped_unread_and_the_receiver_still_serves():
    assert_all_ok(run_here("oversized_messages", 1), 1)


# ------------------------------------------------------------------------- 18.1 shared memory


@pytest.fixture
def small_tmpfs():
    """A real 128 KiB tmpfs: a container's small /dev/shm, in miniature."""
    folder = tempfile.mkdtemp(prefix="pwf-mnt-", dir="/tmp")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k,mode=0700", "tmpfs", folder],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", folder], check=True)
    os.rmdir(folder)


def test_a_small_shm_gives_a_clear_error_naming_the_size_and_shm_size_not_sigbus(small_tmpfs):
    assert_all_ok(run_apart("small_shm", 1, small_tmpfs), 1)


def test_a_truncated_kept_staging_file_is_replaced_not_written_through():
    assert_all_ok(run_apart("truncated_kept_buffer", 2), 2)


def test_a_receiver_rejects_a_kept_buffer_truncated_since_it_was_mapped():
    assert_all_ok(run_apart("truncated_buffer_at_receiver", 2), 2)

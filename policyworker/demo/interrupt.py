"""Ctrl-C during `policyworker demo`: one interrupt ends the run, and nothing it started stays.

`interrupt_once()` turns the first SIGINT into a KeyboardInterrupt and ignores the next ones
while the run's own clean-up (the inference process, the vLLM engine, the Ray group) runs.
`stop_descendants()` then ends every process still running below this one: the processes
multiprocessing started, and the rest of the tree (a local Ray cluster's dashboard helpers,
vLLM's workers), found through /proc on Linux.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["descendant_pids", "interrupt_once", "stop_descendants"]


@contextlib.contextmanager
def interrupt_once() -> Iterator[None]:
    """Inside, the first Ctrl-C raises KeyboardInterrupt and later ones are ignored until the
    block ends, so the clean-up the first one starts is not cut into a second traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first_interrupt(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, first_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def descendant_pids(root: int | None = None) -> list[int]:
    """Every process below `root` (default: this one), parents first; [] where /proc is absent."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        # The command name is in parentheses and may hold spaces: the parent pid follows it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    frontier = [os.getpid() if root is None else root]
    while frontier:
        pid = frontier.pop(0)
        for child in children.get(pid, []):
            found.append(child)
            frontier.append(child)
    return found


def stop_descendants(*, timeout_s: float) -> None:
    """End every process below this one: SIGTERM, up to `timeout_s` to exit, then SIGKILL.

    multiprocessing's resource tracker is left alone: it ignores SIGTERM (the wait would last the
    whole `timeout_s`), and it exits by itself once every process holding its pipe has, after
    unlinking any shared memory they leaked, which a SIGKILL would leave behind.
    """
    import multiprocessing

    tracker = _resource_tracker_pid()
    # the whole tree first: a parent's end would orphan its children
    tree = [pid for pid in descendant_pids() if pid != tracker]
    for child in multiprocessing.active_children():
        child.terminate()
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
        multiprocessing.active_children()  # reaps the ones multiprocessing started
        time.sleep(0.1)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    multiprocessing.active_children()


def _resource_tracker_pid() -> int | None:
    """The pid of this process's multiprocessing resource tracker, None where none runs."""
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent reaps it

"""A no-progress watchdog: a thread that fires when nothing completed for ``timeout_s`` seconds.

The collective refit arms one per call with ``refit_timeout_s``: a peer that
dies mid-broadcast leaves the others blocked inside the communicator, and no RPC can reach a
thread stuck there. The watchdog thread calls ``on_fire`` (which aborts the process group) and
sets ``fired``; the refit's own wait loop sees the flag and raises ``RefitTimeoutError``.

The deadline is about *progress*, not the whole call: every completed collective ``kick``s the
watchdog, so a long refit of a large model never fires while bytes keep moving.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["Watchdog", "check_timeout_s"]


def check_timeout_s(key: str, value: object, *, none_means: str | None = None) -> None:
    """``ValueError`` unless ``value`` is a finite number of seconds > 0 (every wait is bounded;
    ``inf`` would also overflow the waits' C timeouts). ``none_means``: what None stands for,
    when the caller accepts it."""
    if value is None and none_means is not None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    finite = number and math.isfinite(value)  # type: ignore[arg-type]
    if not finite or not value > 0:  # type: ignore[operator]
        also = f", or None ({none_means})" if none_means is not None else ""
        msg = (
            f"{key} {value!r} must be > 0 and finite (seconds){also}; every wait is "
            "bounded: pass a large finite value (e.g. 3600) for a long wait"
        )
        raise ValueError(msg)


class Watchdog:
    """Fires ``on_fire`` once if ``kick`` was not called for ``timeout_s`` seconds while armed.

    Use as a context manager: the thread starts on ``__enter__`` and is stopped (joined) on
    ``__exit__``, so no thread outlives the refit it guards.
    """

    def __init__(
        self, timeout_s: float, on_fire: Callable[[], None], *, name: str = "refit-watchdog"
    ) -> None:
        check_timeout_s("timeout_s", timeout_s)
        self.timeout_s = float(timeout_s)
        self._on_fire = on_fire
        self._name = name
        self._cond = threading.Condition()
        self._last = time.monotonic()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.fired = False
        self.phase = "start"

    def kick(self, phase: str | None = None) -> None:
        """Record progress (and optionally the phase now entered)."""
        with self._cond:
            self._last = time.monotonic()
            if phase is not None:
                self.phase = phase

    def remaining_s(self) -> float:
        """Seconds until the watchdog fires if nothing progresses."""
        with self._cond:
            return self._last + self.timeout_s - time.monotonic()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                left = self._last + self.timeout_s - time.monotonic()
                if left <= 0:
                    self.fired = True
                    break
                self._cond.wait(left)
        if self.fired:
            self._on_fire()

    def __enter__(self) -> Watchdog:
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

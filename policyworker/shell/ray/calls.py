"""The results of one group call: every rank's value in rank order, or the failure by rank.

A rank that raises fails the call with a `WorkerGroupError` naming the rank and the method (its
cause chained); its peers get `_PEER_GRACE_S` to finish the same call (when the raise happened
on every rank, or before any collective, they do, and the group stays usable). A rank that dies,
or peers that do not finish in time (they wait in a collective for the one that left), make
the group unusable: `broken` says why, and the group refuses further calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from policyworker.errors import WorkerGroupError, WorkerGroupTimeoutError

__all__ = ["RankResults"]

_PEER_GRACE_S = 5.0  # after one rank raised: how long the others get to finish the same call


class RankResults:
    """Waits on a group call's refs within `timeout_s`; `broken` is None while the group is
    usable, else why it is not."""

    def __init__(self, ray: Any, *, timeout_s: float) -> None:
        self.ray = ray
        self.timeout_s = timeout_s
        self.broken: str | None = None

    def collect(self, method: str, refs: Sequence[Any]) -> list[Any]:
        """Every ref's value in rank order; the first failure (or the timeout) raises."""
        exceptions = self.ray.exceptions
        deadline = time.monotonic() + self.timeout_s
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        failure: WorkerGroupError | None = None
        while pending:
            ready, _ = self.ray.wait(
                list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break
            rank = pending.pop(ready[0])
            try:
                results[rank] = self.ray.get(ready[0])
            except exceptions.RayActorError as err:
                self.broken = f"rank {rank} died during {method}"
                msg = (
                    f"rank {rank} died during {method} ({type(err).__name__}); the group "
                    f"cannot go on without it: call shutdown() and start a new group"
                )
                raise WorkerGroupError(msg, rank=rank, method=method) from err
            except exceptions.RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                if failure is None:
                    failure = WorkerGroupError(
                        f"rank {rank} raised in {method}: {type(cause).__name__}: {cause}",
                        rank=rank,
                        method=method,
                    )
                    failure.__cause__ = cause
                    deadline = min(deadline, time.monotonic() + _PEER_GRACE_S)
        if pending:
            ranks = sorted(pending.values())
            self.broken = f"ranks {ranks} did not finish {method}"
            if failure is not None:
                msg = f"{failure}; ranks {ranks} are still inside {method}: call shutdown()"
                raise WorkerGroupError(msg, rank=failure.rank, method=method) from failure.__cause__
            msg = (
                f"{method} did not return on ranks {ranks} within timeout_s="
                f"{self.timeout_s} s; call shutdown() and start a new group"
            )
            raise WorkerGroupTimeoutError(msg, rank=ranks[0], method=method)
        if failure is not None:
            raise failure
        return results

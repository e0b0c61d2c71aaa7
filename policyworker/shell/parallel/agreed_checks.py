"""Checks every rank agrees on before the first collective of a call.

A batch check that refuses on one rank only (its shard holds an out-of-vocabulary id, an empty
row) would let the other ranks go on into the call's first collective and wait there for a peer
that never comes, until the collective timeout: under Ray the group then declares itself
unusable. `agreed_checks` runs the checks of its block on every rank, then all-reduces one
refusal flag per rank over the world group: if any rank refused, every rank raises (the refusing
ranks their own error, the others a ValueError naming the first refusing rank and its reason),
so all ranks leave the call together and the process group stays usable.

It costs one all-reduce of one int per rank when every rank accepts (none without a process
group), and a second one carrying the reason's bytes when one refuses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from policyworker.shell.parallel.context import ParallelContext

__all__ = ["AgreedChecks", "PeerRefusedError", "agreed_checks"]

_REASON_BYTES = 4096  # of the first refusing rank's message, sent to the others


class PeerRefusedError(ValueError):
    """Another rank's checks refused its part of the call; this rank's part passed."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled across processes (Ray returns a rank's exception): keep the keyword argument.
        return (_rebuild_peer_refused, (str(self), self.rank))


def _rebuild_peer_refused(message: str, rank: int) -> PeerRefusedError:
    return PeerRefusedError(message, rank=rank)


class AgreedChecks:
    """The context manager of `agreed_checks`; it never swallows an exception."""

    def __init__(self, parallel: ParallelContext, *, what: str) -> None:
        self.parallel = parallel
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        parallel = self.parallel
        if exc is not None and not isinstance(exc, Exception):
            return  # KeyboardInterrupt / SystemExit: leave now, no collective
        if parallel.world_size == 1 or not dist.is_initialized():
            return
        # One int per rank: 0 = accepted, else 1 + the byte length of its reason (capped).
        mine = b"" if exc is None else f"{type(exc).__name__}: {exc}".encode()[:_REASON_BYTES]
        device = parallel._collective_device()
        sizes = torch.zeros(parallel.world_size, dtype=torch.int32, device=device)
        sizes[parallel.rank] = 0 if exc is None else 1 + len(mine)
        parallel.all_reduce(sizes, op="max", axis="world")
        lengths = sizes.tolist()
        refused = [rank for rank, size in enumerate(lengths) if size]
        if not refused:
            return
        # Only on the failure path: every rank learns the first refusing rank's reason, as
        # int32 bytes through the same all-reduce (no object collective, no device guess).
        first = refused[0]
        text = torch.zeros(parallel.world_size, max(lengths), dtype=torch.int32, device=device)
        text[parallel.rank, : len(mine)] = torch.tensor(list(mine), dtype=torch.int32)
        parallel.all_reduce(text, op="sum", axis="world")
        reason = bytes(text[first, : lengths[first] - 1].tolist()).decode(errors="replace")
        if exc is not None:
            return  # this rank's own error goes on unchanged
        others = f" (ranks {refused} refused)" if len(refused) > 1 else ""
        msg = (
            f"rank {first} refused its part of {self.what}{others}, so rank {parallel.rank} "
            f"stops too, before any collective: {reason}"
        )
        raise PeerRefusedError(msg, rank=first)


def agreed_checks(parallel: ParallelContext, *, what: str) -> AgreedChecks:
    """Run the block's checks; raise on every rank if they raised on any rank.

    `what` names the call in the peers' message ("train", "get_logprobs"). The refusing ranks
    raise their own error unchanged, the others `PeerRefusedError` (a ValueError) naming the
    first refusing rank and its reason. KeyboardInterrupt / SystemExit leave without agreeing.
    """
    return AgreedChecks(parallel, what=what)

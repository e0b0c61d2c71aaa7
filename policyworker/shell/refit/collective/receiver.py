"""``CollectiveWeightReceiver``: the inference side of a collective refit.

Receives the header, checks it against its ``refit_info`` and votes, posts ``num_buffers``
bucket receives ahead and applies each bucket through ``HFWeightReceiver``, then commits only
when every rank's status vote says all of them applied everything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

# torch.distributed re-exports these without `as`, so the checker sees them as private there.
from policyworker.errors import RefitError
from policyworker.functional.buckets import (
    unpack_tensors,
)
from policyworker.functional.wire.codec import (
    RefitRejectedError,
)
from policyworker.shell.refit.collective.group import CollectiveRefit, RefitWaits
from policyworker.shell.refit.collective.plan import (
    CollectiveHeader,
    PlannedBucket,
    decode_header,
    plan_collective_buckets,
)
from policyworker.shell.refit.receiver import HFWeightReceiver, RefitReport

__all__ = ["CollectiveWeightReceiver"]


class CollectiveWeightReceiver:
    """The inference side: receives refits broadcast over ``group`` into ``target``.

    ``target`` is an ``HFWeightReceiver`` (its validation, ``atomic`` and ``stale`` semantics are
    used as is), or an ``nn.Module`` / ``load_weights(iterable)`` callable, for which one is built
    from ``refit_info`` and ``atomic``.
    """

    def __init__(
        self,
        target: HFWeightReceiver | nn.Module | Callable[..., Any],
        *,
        group: CollectiveRefit,
        refit_info: Mapping[str, Any] | None = None,
        atomic: bool = False,
    ) -> None:
        if group.is_trainer:
            msg = (
                f"CollectiveWeightReceiver runs on inference ranks >= {group.train_world_size}; "
                f"rank {group.rank} "
                "is a trainer rank: call broadcast_weights there"
            )
            raise ValueError(msg)
        self.receiver = HFWeightReceiver.socketless(target, refit_info=refit_info, atomic=atomic)
        self.group = group
        self.last_header: CollectiveHeader | None = None

    @property
    def version(self) -> int:
        return self.receiver.version

    @property
    def stale(self) -> bool:
        return self.receiver.stale

    def receive(self, *, refit_timeout_s: float | None = None) -> RefitReport:
        """Serve one refit; returns the receiver's report.

        Raises:
            RefitError: this rank rejected the header or failed to apply (its reason), or another
                rank did (nothing committed on any rank).
            RefitTimeoutError: no progress within the deadline, or a peer dropped (group broken).
        """
        group = self.group
        group._check_usable()
        waits = RefitWaits(group, refit_timeout_s)
        with waits.watchdog or contextlib.nullcontext():
            raw = group._exchange_header(waits, None)
            header, reason = None, None
            try:
                header = decode_header(raw)
                self.receiver.begin_refit(list(header.manifest))
            except RefitError as exc:
                reason = f"rank {group.rank} rejected the header: {exc}"
            rejected = group._agree(waits, reason is not None, "header agreement")
            if rejected:
                if reason is None:
                    self.receiver.abort_refit("another rank rejected the header")
                    reason = f"rank(s) {rejected} rejected the header; nothing was written here"
                raise RefitRejectedError(reason)
            assert header is not None
            self.last_header = header
            plan = plan_collective_buckets(
                header.manifest,
                layout=header.layout,
                target_bytes=header.target_bytes,
                alignment=header.alignment,
            )
            reason = self._receive_buckets(waits, plan, header)
            failed = group._agree(waits, reason is not None, "apply status")
            if self.group.device.type == "cuda":
                torch.cuda.current_stream(self.group.device).synchronize()  # weights fully written
        group.refit_seq = header.refit_seq
        if failed:
            self.receiver.abort_refit("a rank failed to apply the refit")
            raise RefitRejectedError(
                reason
                or f"rank(s) {failed} failed to apply refit {header.refit_seq}; not committed"
            )
        return self.receiver.commit_refit(num_buckets=len(plan))

    def _receive_buckets(
        self, waits: RefitWaits, plan: Sequence[PlannedBucket], header: CollectiveHeader
    ) -> str | None:
        group, n = self.group, header.num_buffers
        slots: list[torch.Tensor | None] = [None] * n
        works: list[Any] = [None] * n
        views: list[torch.Tensor | None] = [None] * n

        def post(seq: int) -> None:
            slot = seq % n
            if plan[seq].nbytes:
                buf = group._buffer(slots, slot, plan[seq].nbytes)
                views[slot] = buf
                works[slot] = group._live_pg().broadcast(buf, 0)

        for seq in range(min(n, len(plan))):
            post(seq)
        reason = None
        for seq, bucket in enumerate(plan):
            slot = seq % n
            if works[slot] is not None:
                waits.wait(works[slot], f"bucket {seq}")
                works[slot] = None
            if reason is None:  # after a failure keep draining so the peers never hang
                specs = [header.manifest[i] for i in bucket.indices]
                buf = views[slot] if bucket.nbytes else None
                if buf is None:
                    buf = torch.empty(0, dtype=torch.uint8, device=group.device)
                try:
                    tensors = unpack_tensors(buf, specs, bucket.offsets)
                    self.receiver.apply_batch(
                        [(s.name, t) for s, t in zip(specs, tensors, strict=True)]
                    )
                except (RefitError, ValueError) as exc:
                    reason = f"rank {group.rank} failed to apply bucket {seq}: {exc}"
            if seq + n < len(plan):
                post(seq + n)
        return reason

"""The inference side of every refit transport: validate a weight stream, then apply it.

``HFWeightReceiver(target, *, address, refit_info, atomic=False, timeout_s=120.0)`` serves ZMQ
refits (``receive()``) into ``target``: a Hugging Face ``nn.Module`` (tensors are copied by name
into its live state at the place transformers' checkpoint conversion gives them, e.g. a
per-expert tensor in its slice of a fused MoE tensor; a tied ``lm_head`` follows the
embedding) or a bare ``load_weights(iterable)`` callable
(vLLM style; the tensors it is given are only valid during the call, it must copy them).

Other transports reuse the same validation and apply path through ``begin_refit`` /
``apply_batch`` / ``commit_refit`` / ``abort_refit`` or the one-shot ``apply_named_tensors``.

Every batch is checked (unexpected, duplicate, dtype/shape against the announced manifest, which
was itself checked against ``refit_info``) before any of it is written. ``atomic=True`` stages a
full version and writes it only on commit, so a failed refit leaves the previous version serving;
otherwise a failed refit leaves ``stale`` set until the next complete one.

By default (``one_pass=None``) a receiver of an ``nn.Module`` with a ZMQ address registers for
one-pass refits: its refit weights move once into one shared arena (``one_pass.WeightArena``)
and the sender (whose default picks one-pass wherever the receiver registered) casts its master
weights straight into it — no staging, nothing copied here. A ``load_weights`` callable cannot
register (it transforms what it is given), nor can a module whose refit tensors share memory
without being one parameter (logged); those receive staged refits. ``one_pass=True`` insists
(a target that cannot register raises ``ValueError``), ``one_pass=False`` keeps the weights where
they are and refuses a sender that insists on one-pass, naming the fix. The same manifest
checks run before the sender may write; an in-place receiver is ``stale`` from the one-pass
BEGIN until COMPLETE (serve no inference until ``receive()`` returns), an atomic one has the
sender write a spare copy, copied live on COMPLETE. Staged refits still work on a registered
receiver. A receiver without an address registers when a transport that writes registered
memory asks (``register_one_pass``: the ipc checkpoint engine).

The validate-then-apply path itself is ``weight_applier.WeightApplier``; its names stay
importable from here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from policyworker.errors import RefitError
from policyworker.functional.buckets import TensorSpec
from policyworker.functional.wire.codec import (
    max_message_bytes,
)
from policyworker.shell.refit.one_pass.receiver import WeightArena
from policyworker.shell.refit.watchdog import check_timeout_s
from policyworker.shell.refit.weight_applier import (
    LoadWeights,
    PreparedBatch,
    RefitReport,
    WeightApplier,
    specs_from,
)
from policyworker.shell.refit.zmq.checks import (
    answer_refusal,
    cancel_refusal,
    check_receiver_address,
)
from policyworker.shell.refit.zmq.ipc_files import StagingSpaceError
from policyworker.shell.refit.zmq.receiver import ZmqIpcReceiver
from policyworker.shell.refit.zmq.server import RefitServer

__all__ = ["HFWeightReceiver", "PreparedBatch", "RefitReport", "WeightApplier"]

log = logging.getLogger(__name__)
_NEEDS_MODULE = (
    "one_pass=True needs an nn.Module target (its weights are moved into a shared arena the "
    "sender writes); a load_weights callable transforms what it is given. Pass one_pass=False "
    "(the staged refit)"
)


class HFWeightReceiver:
    """Receives refits into a HF module or a ``load_weights`` callable (the README's
    "Plugging the receiver into an inference engine").

    ``one_pass`` (default None: register wherever the target can). Registering moves the
    module's refit weights into one shared arena now, so the sender casts straight into it
    (docs/refit-protocol.md, "One-pass refits"); staged refits keep working. None registers an
    ``nn.Module`` target with an address and falls back to staged refits (logged) where its
    weights cannot be moved; True registers or raises ``ValueError``; False never registers
    (the weights stay where they are, e.g. when CUDA graphs hold their addresses). Between a
    one-pass ``receive()`` call and its return serve no inference: an in-place receiver is
    ``stale`` from the sender's first write until COMPLETE.
    """

    def __init__(
        self,
        target: nn.Module | LoadWeights,
        *,
        address: str | None,
        refit_info: Mapping[str, Any],
        atomic: bool = False,
        timeout_s: float = 120.0,
        one_pass: bool | None = None,
    ) -> None:
        check_timeout_s("timeout_s", timeout_s)
        if (one_pass is not None and not isinstance(one_pass, bool)) or (
            one_pass and address is None
        ):
            msg = (
                f"one_pass={one_pass!r} must be None (register where the target can), True or "
                "False, and True needs a ZMQ address (the sender writes the registered memory "
                "over that connection's protocol)"
            )
            raise ValueError(msg)
        if not refit_info:
            msg = "refit_info is empty; pass the trainer's prepare_refit_info() result"
            raise ValueError(msg)
        if address is not None:
            check_receiver_address(address)
            cancel_refusal(address)  # an earlier refused receiver here no longer answers
        try:
            self.applier = WeightApplier(target, refit_info, atomic=atomic)
        except ValueError as exc:
            if address is not None:  # tell the sender now, not after its timeout
                answer_refusal(
                    address,
                    f"the receiver refused refit_info when it was built: {exc}",
                    timeout_s=timeout_s,
                )
            raise
        self.refit_info = self.applier.expected
        self.address = address
        # the weights move into a shared arena now, once (an explicit one_pass=True's refusal
        # raises here)
        self.arena = _register(
            target, self.applier, atomic=atomic, one_pass=one_pass, where=address
        )
        self._target, self._atomic, self._one_pass = target, atomic, one_pass
        # a default (one_pass=None) registration already tried and declined is not tried again
        self._declined = address is not None and self.arena is None
        if one_pass and self.arena is None:
            raise ValueError(_NEEDS_MODULE)
        self._server = RefitServer(self.applier, one_pass=self.arena)
        cap = max_message_bytes(tuple(self.applier.manifest_specs()))  # nothing larger is read
        self._socket = (
            ZmqIpcReceiver(address, timeout_s=timeout_s, max_message_bytes=cap)
            if address is not None
            else None
        )

    @classmethod
    def socketless(
        cls,
        target: HFWeightReceiver | nn.Module | LoadWeights,
        *,
        refit_info: Mapping[str, Any] | None,
        atomic: bool = False,
    ) -> HFWeightReceiver:
        """`target` itself if it is a receiver, else a receiver without a ZMQ socket around it,
        for transports that bring their own bytes (collective broadcast, SGLang payloads)."""
        if isinstance(target, HFWeightReceiver):
            return target
        if refit_info is None:
            msg = (
                "refit_info is required unless target is an HFWeightReceiver; pass the "
                "trainer's prepare_refit_info()"
            )
            raise ValueError(msg)
        return cls(target, address=None, refit_info=refit_info, atomic=atomic)

    @property
    def version(self) -> int:
        """Number of complete refits applied so far."""
        return self.applier.version

    @property
    def stale(self) -> bool:
        """True after a failed in-place refit wrote some tensors.

        Cleared by the next complete one.
        """
        return self.applier.stale

    def register_one_pass(self, one_pass: bool | None, *, where: str) -> WeightArena | None:
        """The arena a one-pass sender writes, registering now when this receiver has none.

        For transports that bring their own connection (the ipc checkpoint engine): a
        ``socketless`` receiver registers only when one asks, so the other transports never
        move its weights. ``one_pass`` is the transport's setting (None: where the target can,
        False: never, True: or ``ValueError``); a receiver built with ``one_pass=False`` never
        registers. ``where`` names the connection in the log of a target that cannot register.
        """
        if one_pass is False or self._one_pass is False:
            if one_pass:
                msg = (
                    "one_pass=True: this receiver was built with one_pass=False (its weights "
                    "stay where they are); pass one_pass=False or None to the transport"
                )
                raise ValueError(msg)
            return None
        if self.arena is None and (one_pass or not self._declined):
            self.arena = _register(
                self._target, self.applier, atomic=self._atomic, one_pass=one_pass, where=where
            )
            self._server.one_pass = self.arena
            self._declined = self.arena is None
        if one_pass and self.arena is None:
            raise ValueError(_NEEDS_MODULE)
        return self.arena

    def receive(self) -> RefitReport:
        """Serve one complete ZMQ refit.

        Raises ``RefitError`` (or ``RefitTimeoutError``) otherwise.
        """
        if self._socket is None:
            msg = "receive() needs a ZMQ address; this receiver was built with address=None"
            raise ValueError(msg)
        check_receiver_address(self.address)  # the trainer may have shut down since
        return self._socket.serve(self._server)

    def begin_refit(self, manifest: Mapping[str, Any] | Sequence[TensorSpec]) -> None:
        """Start a refit announced by another transport; checks the manifest against refit_info."""
        self.applier.begin(specs_from(manifest))

    def apply_batch(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate a batch of named tensors, then write it (or stage it when atomic)."""
        try:
            self.applier.apply_batch(list(pairs))
        except RefitError:
            self.applier.abort("batch rejected")
            raise

    def commit_refit(self, *, num_buckets: int = 0) -> RefitReport:
        """Finish the refit: every manifest name must have arrived."""
        try:
            return self.applier.commit(num_buckets=num_buckets)
        except RefitError:
            self.applier.abort("incomplete")
            raise

    def abort_refit(self, reason: str) -> None:
        """Drop the refit in progress (the caller reports `reason`); an in-place receiver's model
        stays marked stale if anything was written."""
        self.applier.abort(reason)

    def release_buffers(self) -> None:
        """Unmap the staging buffers a ``keep_staging`` sender keeps between refits (they are
        mapped once and reused otherwise); call it before offloading, or when the trainer calls
        ``release_staging()``, so that memory can really be returned. No-op during a refit."""
        self._server.release_buffers()

    def apply_named_tensors(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        *,
        manifest: Mapping[str, Any] | Sequence[TensorSpec],
    ) -> RefitReport:
        """One whole refit from an in-process iterable of ``(hf_name, tensor)``."""
        self.begin_refit(manifest)
        self.apply_batch(pairs)
        return self.commit_refit(num_buckets=1)

    def close(self) -> None:
        """Close from any thread: a ``receive()`` waiting in another one raises
        ``ReceiverClosedError`` (see ``ZmqIpcReceiver.close``)."""
        if self._socket is not None:
            self._socket.close()
        self._server.release_buffers()
        if self.arena is not None and not self._server.in_refit:
            self.arena.close()  # unlinks the arena's file; the module keeps its mapping


def _register(
    target: nn.Module | LoadWeights,
    applier: WeightApplier,
    *,
    atomic: bool,
    one_pass: bool | None,
    where: str | None,
) -> WeightArena | None:
    """The arena of a receiver that registers for one-pass refits, else None (staged); ``where``
    names its connection (None: it has none, so it does not register)."""
    if one_pass is False or where is None or not isinstance(target, nn.Module):
        return None
    if one_pass:
        return WeightArena(target, applier, atomic=atomic)
    casts = casts_on_receive(applier)
    if casts:  # the sender writes the manifest's dtype; only this side's copy can cast
        log.info(
            "refit receiver at %s: staged refits only (%d tensor(s) are cast on receive, e.g. %s)",
            where,
            len(casts),
            casts[0],
        )
        return None
    try:
        return WeightArena(target, applier, atomic=atomic)
    # the module keeps valid weights either way (moved into the arena or not); a target that
    # cannot register, or no room for the arena, leaves the staged refit
    except (ValueError, StagingSpaceError, torch.OutOfMemoryError) as exc:
        log.warning("refit receiver at %s: staged refits only (%s)", where, exc)
        return None


def casts_on_receive(applier: WeightApplier) -> list[str]:
    """The refit names whose live tensor differs from the announced dtype or shape (e.g. an
    fp32 router bias into a bf16 model): a one-pass sender could not write them."""
    dests = applier.destinations() or {}
    return [
        f"{name!r}: {dtype} {tuple(shape)} into {dest.dtype} {tuple(dest.shape)}"
        for name, (shape, dtype) in applier.expected.items()
        if (dest := dests.get(name)) is not None
        and (dest.dtype != dtype or tuple(dest.shape) != tuple(shape))
    ]

"""Refits of a module that keeps sampling: ``InflightWeights``.

A background thread serves ZMQ refits into an atomic receiver's staging (the transfer) while
the owner keeps decoding; between two decode steps the owner calls ``swap()``, which copies the
newest complete staged version into the live module: when every refit name is a whole parameter
of the module (same shape and dtype) the swap re-points those parameters at the staged tensors
and copies nothing; otherwise it copies through the module's checkpoint layout. The swap is the
only stall a request sees; the transfer runs beside the decoding. (A re-pointed parameter has
new storage: anything that captured the old pointers, such as a CUDA graph, must not be used
with this module.) A transfer failing midway never reaches the staging slot,
so the previous version keeps serving and the thread waits for the next refit.

An HF module on a GPU (or any HF module with ``one_pass=True``) is served one-pass instead:
the receiver registers an atomic arena (its weights moved once into one allocation, and a
spare of it), the trainer casts each version straight into the spare from its own process, and
the swap copies spare -> live in one copy on the decoding stream (a read and a write of the
weights at the GPU's copy rate; the live weights keep their addresses). The
receiving thread then only answers BEGIN and COMPLETE: with a host-bound decode loop, staging
every bucket in this interpreter would take the transfer's host time from the decode steps.

With a ``shadow`` (an object with ``load(pairs)`` and ``exchange()``, such as the vLLM worker's
``ShadowWeights``) the receiving thread loads each complete version into the shadow as soon as
it arrives, and ``swap()`` only exchanges shadow and live: the load (kernel repacking included)
runs beside the decoding too. A shadow load failing midway counts as a failed refit; the live
weights never saw it.

Versions: ``version`` is the number of refits received complete when the serving weights
arrived (0: the weights the module was built with). A trainer that refits once after every
optimizer step therefore tags each token with its own ``policy_version`` of those weights. A
version overtaken by a newer one before a swap is never served.

On a GPU the staging copies run on a stream of their own (the receiving thread's current
stream), so they overlap the decode kernels instead of queueing behind them on the default
stream. Each staged version carries an event recorded after its last copy; the swap makes the
decoding stream wait for that event (not for a newer refit already copying) and marks the staged
tensors as used by the decoding stream, so the caching allocator reuses their memory only after
the decoding stream is done with them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import attrs
import torch
from torch import nn

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import TensorSpec
from policyworker.shell.refit.receiver import HFWeightReceiver, casts_on_receive
from policyworker.shell.refit.watchdog import check_timeout_s
from policyworker.shell.refit.weight_applier import LoadWeights, WeightApplier
from policyworker.shell.refit.zmq.ipc_files import StagingSpaceError
from policyworker.shell.refit.zmq.receiver import ReceiverClosedError

__all__ = ["InflightWeights", "Shadow", "Swap"]

log = logging.getLogger("policyworker")


class Shadow(Protocol):
    """A second weight set: ``load`` fills it off the decode path, ``exchange`` makes it live."""

    def load(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def exchange(self) -> None: ...


@attrs.frozen
class Swap:
    """One swap between decode steps: the version now serving and how long the copy took."""

    version: int
    seconds: float


@attrs.frozen
class _Staged:
    version: int
    pairs: list[tuple[str, torch.Tensor]]
    copied: torch.cuda.Event | None = None  # recorded on the copy stream after the last copy


def _cuda_device(module: nn.Module | LoadWeights) -> torch.device | None:
    """The CUDA device of a module's parameters (None: a callable, or not on a GPU)."""
    if not isinstance(module, nn.Module):
        return None
    first = next(module.parameters(), None)
    return first.device if first is not None and first.device.type == "cuda" else None


def _whole_parameters(
    module: nn.Module | LoadWeights, refit_info: Mapping[str, Any]
) -> dict[str, nn.Parameter] | None:
    """{refit name: the parameter it is, whole} when every refit name is one parameter of
    ``module`` with the refit's shape and dtype (a swap then re-points them at the staged
    tensors); None otherwise (a callable, buffers, fused or sliced destinations: the swap
    copies through the module's checkpoint layout)."""
    if not isinstance(module, nn.Module):
        return None
    params = dict(module.named_parameters(remove_duplicate=False))
    found = {}
    for name, (shape, dtype) in refit_info.items():
        param = params.get(name)
        if param is None or tuple(param.shape) != tuple(shape) or param.dtype != dtype:
            return None
        found[name] = param
    return found


class InflightWeights:
    """Stage ZMQ refits of ``module`` in the background; ``swap()`` makes the newest one live.

    ``module`` is a HF module (the swap copies into its tensors) or a ``load_weights(pairs)``
    callable (the swap hands it the staged version; vLLM's layerwise loader, for example).

    ``one_pass``: None serves an HF module on a GPU one-pass (module doc) and everything else
    staged; True insists (``ValueError`` where the module cannot register); False stages.

    ``start()`` begins serving refits on a daemon thread (every wait bounded by ``timeout_s``;
    an idle wait simply waits again); ``close()`` stops it. ``failures`` counts refits that
    failed midway (``last_error`` says why); none of them changed the serving weights.
    """

    def __init__(
        self,
        module: nn.Module | LoadWeights,
        *,
        address: str,
        refit_info: Mapping[str, Any],
        timeout_s: float = 120.0,
        shadow: Shadow | None = None,
        one_pass: bool | None = None,
    ) -> None:
        check_timeout_s("timeout_s", timeout_s)
        self._shadow = shadow
        # held while the shadow loads and while it is exchanged: a pending version is the
        # shadow's content only while no load is under way
        self._shadow_lock = threading.Lock()
        self._live = WeightApplier(module, refit_info, atomic=False)
        self._params = _whole_parameters(module, refit_info)
        self._device = _cuda_device(module)
        self._copy_stream = torch.cuda.Stream(self._device) if self._device is not None else None
        self._specs: tuple[TensorSpec, ...] = tuple(self._live.manifest_specs())
        one_pass_receiver = None
        if shadow is None:
            one_pass_receiver = _one_pass_receiver(
                module, address, refit_info, timeout_s=timeout_s, one_pass=one_pass
            )
        # atomic + a callable target: every tensor is copied into staging as it arrives, and the
        # callable is given those staged copies (owned from then on) only once all arrived
        self._receiver = one_pass_receiver or HFWeightReceiver(
            self._stage, address=address, refit_info=refit_info, atomic=True, timeout_s=timeout_s
        )
        self._arena = None if one_pass_receiver is None else one_pass_receiver.arena
        self._cond = threading.Condition()
        self._pending: _Staged | None = None
        self._received = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.version = 0
        self.failures = 0
        self.last_error: BaseException | None = None

    @property
    def mode(self) -> str:
        """How a swap makes a version live: ``one_pass`` (copy the held spare live), ``shadow``
        (exchange) or ``load`` (load the staged version then)."""
        if self._arena is not None:
            return "one_pass"
        return "load" if self._shadow is None else "shadow"

    @property
    def closed(self) -> bool:
        """``close()`` was called: this receiver serves no more refits."""
        return self._closed

    @property
    def received(self) -> int:
        """Refits received complete so far (the newest staged or serving version)."""
        with self._cond:
            return self._received

    def start(self) -> None:
        """Serve refits on a background thread until ``close()``."""
        if self._thread is not None:
            msg = "InflightWeights.start() was already called; one serving thread per receiver"
            raise ValueError(msg)
        self._thread = threading.Thread(target=self._serve, name="inflight-refit", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        stream = self._copy_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._serve_on_this_stream()

    def _serve_on_this_stream(self) -> None:
        while not self._closed:
            try:
                self._receiver.receive()
                if self._arena is not None:  # the version is held in the spare arena
                    self._publish([], None)
            except ReceiverClosedError:
                return
            except RefitTimeoutError as exc:
                if self._receiver_mid_refit(exc):
                    self._failed(exc)
            except (RefitError, OSError, ValueError) as exc:  # the previous version still serves
                self._failed(exc)

    @staticmethod
    def _receiver_mid_refit(exc: RefitTimeoutError) -> bool:
        return "phase 'begin'" not in str(exc)  # an idle wait for the next refit is no failure

    def _failed(self, exc: BaseException) -> None:
        with self._cond:
            self.failures += 1
            self.last_error = exc
            self._cond.notify_all()

    def _stage(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        staged = list(pairs)
        copied = None
        if self._copy_stream is not None:  # called on the receiving thread, after every copy
            # a host transport (shm) stages on the host: move each tensor to the module's GPU
            # here, off the decoding thread, so the swap re-points instead of copying
            staged = [(n, t.to(self._device)) for n, t in staged]
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        if self._shadow is not None:
            with self._shadow_lock:
                with self._cond:  # the version waiting in the shadow is overwritten now
                    self._pending = None
                self._shadow.load(staged)  # raising: a failed refit, the live weights untouched
                self._publish([], copied)
            return
        self._publish(staged, copied)

    def _publish(self, staged: list[tuple[str, torch.Tensor]], copied: Any) -> None:
        with self._cond:
            self._received += 1
            self._pending = _Staged(self._received, staged, copied)
            self._cond.notify_all()

    def wait(self, *, received: int = 0, failures: int = 0, timeout_s: float) -> bool:
        """Wait until at least ``received`` refits arrived complete and ``failures`` failed;
        False when ``timeout_s`` passes first."""
        check_timeout_s("timeout_s", timeout_s)
        with self._cond:
            return self._cond.wait_for(
                lambda: self._received >= received and self.failures >= failures,
                timeout=timeout_s,
            )

    @property
    def pending(self) -> bool:
        """A complete version is staged and waits for ``swap()``."""
        with self._cond:
            return self._pending is not None

    def swap(self) -> Swap | None:
        """Make the newest staged version live (call it between decode steps, from the thread
        that decodes); None when nothing new is staged."""
        if self._shadow is not None:
            return self._exchange()
        if self._arena is not None:
            return self._commit_held()
        with self._cond:
            staged, self._pending = self._pending, None
        if staged is None:
            return None
        start = time.perf_counter()
        if staged.copied is not None:
            decoding = torch.cuda.current_stream(self._device)
            decoding.wait_event(staged.copied)
            for _, tensor in staged.pairs:
                tensor.record_stream(decoding)
        params = self._params
        if params is not None and all(t.device == params[n].device for n, t in staged.pairs):
            retired = []
            with torch.no_grad():  # every name is a whole parameter: re-point, copy nothing
                for name, tensor in staged.pairs:
                    retired.append(params[name].data)
                    params[name].data = tensor
            # freeing the old version (one munmap per large tensor) is no part of the stall
            threading.Thread(target=retired.clear, name="inflight-free", daemon=True).start()
        else:
            self._live.begin(self._specs)
            self._live.apply_batch(staged.pairs)
            self._live.commit(num_buckets=1)
        self.version = staged.version
        return Swap(staged.version, time.perf_counter() - start)

    def _commit_held(self) -> Swap | None:
        assert self._arena is not None
        with self._cond:
            staged, self._pending = self._pending, None
        if staged is None:
            return None
        start = time.perf_counter()
        if not self._arena.commit_held():
            return None  # a newer version is being written over it: a later swap serves that
        self.version = staged.version
        return Swap(staged.version, time.perf_counter() - start)

    def _exchange(self) -> Swap | None:
        assert self._shadow is not None
        if not self._shadow_lock.acquire(blocking=False):
            return None  # a newer version is loading into the shadow: the next swap serves it
        try:
            with self._cond:
                staged, self._pending = self._pending, None
            if staged is None:
                return None
            start = time.perf_counter()
            self._shadow.exchange()
            self.version = staged.version
            return Swap(staged.version, time.perf_counter() - start)
        finally:
            self._shadow_lock.release()

    def close(self) -> None:
        """Stop serving (from any thread); a refit in progress is dropped."""
        self._closed = True
        self._receiver.close()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _one_pass_receiver(
    module: nn.Module | LoadWeights,
    address: str,
    refit_info: Mapping[str, Any],
    *,
    timeout_s: float,
    one_pass: bool | None,
) -> HFWeightReceiver | None:
    """An atomic one-pass receiver of ``module`` holding each version in its spare arena until
    the swap; None where ``one_pass`` (None: GPU modules only) or the module rules it out."""
    if one_pass is False or not isinstance(module, nn.Module):
        if one_pass:
            raise ValueError("one_pass=True needs an nn.Module (a callable cannot register)")
        return None
    if one_pass is None:
        if _cuda_device(module) is None:
            return None
        casts = casts_on_receive(WeightApplier(module, refit_info, atomic=False))
        if casts:
            log.info("in-flight refits staged: %d tensor(s) are cast on receive", len(casts))
            return None
    try:
        receiver = HFWeightReceiver(
            module,
            address=address,
            refit_info=refit_info,
            atomic=True,
            timeout_s=timeout_s,
            one_pass=True,
        )
    # no room for the arena, or a module that cannot register: the staged path still serves
    except (ValueError, StagingSpaceError, torch.OutOfMemoryError) as exc:
        if one_pass:
            raise
        log.warning("in-flight refits staged: %s", exc)
        return None
    assert receiver.arena is not None
    receiver.arena.hold_versions()
    return receiver

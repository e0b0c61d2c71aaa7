"""The receiver's side of a one-pass refit: its weights moved into one shared arena, registered.

``WeightArena`` moves every tensor a refit writes (the module's parameters and buffers whose
memory some refit name lands in: a whole weight, or the fused MoE tensor an expert's slice
lives in) into one shared allocation — a 0600 /dev/shm file mapped shared on CPU, one CUDA
allocation shared by its IPC handle on a GPU — and points each of them at its view of it, once.
The sender then casts its fp32 master weights straight into those views: one pass, no staging.

Why an arena rather than the IPC handles of the weights where they are: a shared mapping is the
only way another process can write a CPU tensor, so the same code runs (and is tested) on CPU
and CUDA; and one handle is opened once instead of one per weight. The cost is one copy of the
weights when the receiver is built. A module whose weights are re-pointed again afterwards (a
reload) is noticed at the next one-pass BEGIN: the arena is rebuilt under a new registration id,
so the sender never writes through a stale layout.

``atomic=True`` adds a spare arena of the same layout (a copy of the live one): the sender writes
the spare, and COMPLETE copies spare → live in one copy, so a failed refit never touches the
live weights and no parameter is re-pointed per refit (CUDA graphs keep their addresses).

``hold_versions()`` (an atomic arena serving refits in flight) defers that copy: COMPLETE leaves
the version in the spare, and the owner's ``commit_held()`` copies it live between two decode
steps, on the decoding thread's stream. The next BEGIN drops a version still held (the sender is
about to overwrite the spare); a refit failing midway leaves nothing held.
"""

from __future__ import annotations

import bisect
import secrets
import threading

import torch
from torch import nn

from policyworker.functional.arena import (
    Destination,
    destination_of,
    destination_view,
    plan_arena,
)
from policyworker.functional.buckets import DEFAULT_ALIGNMENT
from policyworker.functional.wire.checks import self_overlap_problem
from policyworker.functional.wire.codec import ProtocolError
from policyworker.functional.wire.one_pass import Registration
from policyworker.shell.refit.weight_applier import WeightApplier
from policyworker.shell.refit.zmq.staging import CudaStaging, ShmStaging, open_event

__all__ = ["WeightArena"]


def _bases(module: nn.Module, dests: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The module's tensors (parameters or buffers, each once) whose memory the destinations
    are views of, in address order; ``ValueError`` when they cannot be moved safely."""
    spans: list[tuple[int, int, str, torch.Tensor]] = []  # (first byte, end, name, tensor)
    seen: set[int] = set()
    for name, value in module.state_dict(keep_vars=True).items():
        if value.nbytes == 0 or id(value) in seen:  # empty, or a tied weight met again
            continue
        seen.add(id(value))
        spans.append((value.data_ptr(), value.data_ptr() + value.nbytes, name, value))
    spans.sort(key=lambda span: span[0])
    for (_, end, name, _), (start, _, other, _) in zip(spans, spans[1:], strict=False):
        if start < end:
            msg = (
                f"one_pass: {name!r} and {other!r} share memory without being one parameter, so "
                "neither can be moved into an arena alone; use the staged refit "
                "(one_pass=False) for this model"
            )
            raise ValueError(msg)
    starts = [span[0] for span in spans]
    wanted: dict[int, torch.Tensor] = {}
    for name, dest in dests.items():
        if dest.numel() == 0:
            continue
        k = bisect.bisect_right(starts, dest.data_ptr()) - 1
        if k < 0 or not spans[k][0] <= dest.data_ptr() < spans[k][1]:
            msg = f"one_pass: {name!r} is not held by a parameter or buffer of the module"
            raise ValueError(msg)
        base = spans[k][3]
        if not base.is_contiguous():
            msg = f"one_pass: the tensor holding {name!r} is not contiguous; call .contiguous()"
            raise ValueError(msg)
        wanted[id(base)] = base
    devices = {b.device for b in wanted.values()}
    if len(devices) > 1:
        msg = f"one_pass: the refit's weights are on several devices {sorted(map(str, devices))}"
        raise ValueError(msg)
    return sorted(wanted.values(), key=lambda b: b.data_ptr())


class WeightArena:
    """A module's refit weights living in one shared arena, and the registration describing it.

    Built once (``one_pass=True`` on the receiver); ``registration()`` at each one-pass BEGIN
    (rebuilt if the module's weights were re-pointed since), ``before_write`` when the sender may
    start writing, ``after_write`` on COMPLETE, before the new version is reported.
    """

    def __init__(self, module: nn.Module, applier: WeightApplier, *, atomic: bool) -> None:
        self.module, self.applier, self.atomic = module, applier, atomic
        self._events: dict[bytes, torch.cuda.Event] = {}
        self._hold = False
        self._lock = threading.Lock()
        self._held = False  # the spare holds a complete version not yet copied live
        self._build()

    def _build(self) -> None:
        self.applier.rebind(self.module)  # where the module's weights are now
        dests = self.applier.destinations()
        if dests is None:
            msg = (
                "one_pass=True needs an nn.Module target (its weights are moved into a shared "
                "arena); a load_weights callable transforms what it is given, so the sender "
                "cannot write its memory. Pass one_pass=False"
            )
            raise ValueError(msg)
        overlaps = [
            p
            for n, t in dests.items()
            if (p := self_overlap_problem(n, tuple(t.shape), t.stride())) is not None
        ]
        if overlaps:
            msg = "one_pass: cannot register " + "; ".join(overlaps[:20])
            raise ValueError(msg)
        bases = _bases(self.module, dests)
        device = bases[0].device if bases else torch.device("cpu")
        plan = plan_arena([b.nbytes for b in bases], alignment=DEFAULT_ALIGNMENT)
        live = _allocate(plan.total_bytes, device)
        arena = live.tensor
        assert arena is not None
        with torch.no_grad():
            for base, offset in zip(bases, plan.offsets, strict=True):
                view = arena[offset : offset + base.nbytes].view(base.dtype).view(base.shape)
                view.copy_(base.detach())
                base.data = view  # the module's own tensor object now lives in the arena
        self.applier.rebind(self.module)  # its destinations are views of the arena now
        spare = None
        if self.atomic:
            spare = _allocate(plan.total_bytes, device)
            assert spare.tensor is not None
            spare.tensor.copy_(arena)  # bytes no refit name covers stay equal to the live ones
        moved = self.applier.destinations()
        assert moved is not None
        destinations = tuple(
            destination_of(t, arena, name=n)
            if t.numel()
            else Destination(n, t.dtype, tuple(t.shape), t.stride(), 0)  # nothing to write
            for n, t in moved.items()
        )
        self._live, self._spare, self._bases = live, spare, bases
        self._held = False  # a new spare holds the live version
        self._addresses = [b.data_ptr() for b in bases]
        self._registration = Registration(
            secrets.token_hex(8),
            live.ref(),
            None if spare is None else spare.ref(),
            plan.total_bytes,
            destinations,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the weights' old blocks go back to the driver

    @property
    def tensor(self) -> torch.Tensor:
        """The live arena (flat uint8)."""
        assert self._live.tensor is not None
        return self._live.tensor

    def intact(self) -> bool:
        """Every moved tensor still lives where it was registered and is still the module's
        (no reload re-pointed it, nor put new tensor objects in its place)."""
        return (
            self._live.intact()
            and [b.data_ptr() for b in self._bases] == self._addresses
            and not self.applier.module_moved()
        )

    @property
    def write_target(self) -> torch.Tensor:
        """The arena a one-pass sender writes: the spare of an atomic receiver, else the live
        one (flat uint8)."""
        target = self._live if self._spare is None else self._spare
        assert target.tensor is not None
        return target.tensor

    def registration(self) -> Registration:
        """The current registration; a new one (new id) when the module's layout changed."""
        if not self.intact():
            self.close()
            self._build()
        return self._registration

    def hold_versions(self) -> None:
        """From now on COMPLETE keeps each version in the spare until ``commit_held()``."""
        if not self.atomic:
            raise ValueError("hold_versions() needs an atomic arena (the sender writes a spare)")
        self._hold = True

    def commit_held(self) -> bool:
        """Copy the version the spare holds live, on the caller's current stream; False (nothing
        copied) when none is held: none arrived, or a newer one is being written over it."""
        with self._lock:
            if not self._held:
                return False
            assert self._spare is not None and self._spare.tensor is not None
            self.tensor.copy_(self._spare.tensor)  # ordered before the caller's next kernels
            self._held = False
            return True

    def before_write(self) -> None:
        """Let the sender write: the GPU's reads of the weights queued so far are finished
        (a held version's copy to live among them, which no later commit repeats)."""
        with self._lock:
            self._held = False
        if self.tensor.device.type == "cuda":
            torch.cuda.synchronize(self.tensor.device)

    def after_write(self, written_event: bytes | None) -> None:
        """The sender's writes are visible here; an atomic receiver's spare is copied live.
        ``written_event`` None: the transport delivered the bytes before COMPLETE (NIXL)."""
        device = self.tensor.device
        if device.type == "cuda" and written_event is not None:
            if not written_event:
                msg = "a one-pass CUDA COMPLETE carries no written-event handle (protocol mismatch)"
                raise ProtocolError(msg)
            event = self._events.get(written_event)
            if event is None:
                if len(self._events) >= 16:  # a misbehaving sender must not grow this unbounded
                    self._events.clear()
                event = self._events[written_event] = open_event(device, written_event)
            torch.cuda.current_stream(device).wait_event(event)
        if self._spare is not None and not self._hold:
            assert self._spare.tensor is not None
            self.tensor.copy_(self._spare.tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the new version is in place before anyone is told
        with self._lock:
            self._held = self._hold

    def spare_view(self, name: str) -> torch.Tensor:
        """What the sender wrote for ``name`` in the spare arena (tests; atomic receivers only)."""
        assert self._spare is not None and self._spare.tensor is not None
        dest = next(d for d in self._registration.destinations if d.name == name)
        return destination_view(self._spare.tensor, dest)

    def close(self) -> None:
        """Drop the spare and this side's hold on the arena file (the weights stay readable: the
        module's tensors keep their mapping; the file name is unlinked)."""
        for staging in (self._live, self._spare):
            if staging is not None:
                staging.close()
        self._spare = None


def _allocate(nbytes: int, device: torch.device) -> ShmStaging | CudaStaging:
    return CudaStaging(nbytes, device) if device.type == "cuda" else ShmStaging(nbytes)

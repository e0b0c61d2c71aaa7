"""``WeightApplier``: checks each batch of a refit against its manifest, then writes it.

The one apply path of every refit transport (``HFWeightReceiver`` over ZMQ, the collective and
SGLang receivers through it): ``begin`` checks the announced manifest against ``refit_info``;
every batch (by name, by manifest index, or prepared once and re-applied) is checked before any
of it is written; ``commit`` reports a ``RefitReport``. With ``atomic=True`` a whole version is
staged and written only on commit. A target is a Hugging Face module (tensors land where
transformers' checkpoint conversion puts them) or a ``load_weights`` callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter, is_
from typing import Any

import attrs
import torch
from torch import nn

from policyworker.functional.buckets import TensorSpec
from policyworker.functional.names import canonical_name, is_lora_param, pieces_by_checkpoint_name
from policyworker.functional.wire.codec import (
    ProtocolError,
    check_manifest,
    dtype_name,
)
from policyworker.shell.refit.hf_names import checkpoint_layout
from policyworker.shell.refit.live_state import ModuleTree
from policyworker.shell.refit.weight_stream import tie_word_embeddings
from policyworker.shell.refit.zmq.receiver import expected_from_refit_info
from policyworker.shell.refit.zmq.staging import copy_groups, grouped_copy_, run_copy_groups

__all__ = ["LoadWeights", "PreparedBatch", "RefitReport", "WeightApplier", "specs_from"]

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


@attrs.frozen
class RefitReport:
    """One completed refit: the receiver's new version, what arrived, how long it took."""

    version: int
    names: tuple[str, ...]
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float

    def summary(self) -> dict[str, Any]:
        """The report as plain values without the names (what an engine's RPC returns)."""
        return {
            "version": self.version,
            "num_tensors": self.num_tensors,
            "num_bytes": self.num_bytes,
            "num_buckets": self.num_buckets,
            "receive_seconds": self.seconds,
        }


def _module_destinations(
    module: nn.Module, expected: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, torch.Tensor]:
    """The live tensor (or the piece of one, e.g. an expert of a fused MoE tensor) each
    checkpoint name is written into: the module's own checkpoint layout, as transformers
    saves it."""
    state = {canonical_name(k): v for k, v in module.state_dict(keep_vars=True).items()}
    saved = {n: v for n, v in state.items() if not is_lora_param(n)}
    if tie_word_embeddings(module):
        saved.pop("lm_head.weight", None)  # follows the embedding, as save_pretrained leaves it out
    layout = checkpoint_layout(module, {n: v.shape for n, v in saved.items()})
    located = pieces_by_checkpoint_name(layout)
    dests: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, (shape, _) in expected.items():
        if name in located:
            source, piece = located[name]
            live = state[source]
            dest = live if piece.is_whole(live.shape) else piece.view_of(live.detach())
        elif name in state:  # e.g. a tied lm_head.weight sent anyway
            dest = state[name]
        else:
            problems.append(f"{name!r}: no such parameter or buffer")
            continue
        if tuple(dest.shape) != tuple(shape):
            problems.append(
                f"{name!r}: module has shape {list(dest.shape)}, refit_info says {list(shape)}"
            )
        dests[name] = dest.data if isinstance(dest, nn.Parameter) else dest
    if problems:
        msg = (
            f"target module cannot receive {len(problems)} refit tensor(s): "
            + "; ".join(problems[:20])
            + ". Build the receiver's model from the same config as the trainer's, or pass a "
            "load_weights callable that knows these names."
        )
        raise ValueError(msg)
    return dests


class _Where:
    """Where a module's tensors live: its module tree, and each parameter and buffer of every
    module in it (the object in its module's slot, and its address).

    ``holds`` is false once a parameter or buffer was re-pointed (``.to()`` round trip,
    ``.data =``, ``load_state_dict(assign=True)``, a new ``nn.Parameter`` set, one deleted) or
    any module of the tree added, removed or replaced. The old destinations are still alive
    (the applier holds them), so no address can come back on another tensor.
    """

    def __init__(self, module: nn.Module) -> None:
        self.tree = ModuleTree.of(module)
        self.owners: tuple[list[nn.Module], list[nn.Module]] = ([], [])
        self.keys: tuple[list[str], list[str]] = ([], [])
        self.tensors: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for owner in {id(m): m for m in self.tree.modules()}.values():  # a shared one once
            for kind, slots in enumerate((owner._parameters, owner._buffers)):
                for key, tensor in slots.items():
                    if tensor is not None:
                        self.owners[kind].append(owner)
                        self.keys[kind].append(key)
                        self.tensors[kind].append(tensor)
        self.addresses = self._addresses()

    def _addresses(self) -> list[int]:
        return [t.data_ptr() for kind in self.tensors for t in kind]

    def holds(self, module: nn.Module) -> bool:
        """``module`` is still made of these modules and tensors, at these addresses."""
        if not self.tree.same_as(ModuleTree.of(module)):
            return False
        for kind, slots in enumerate((_PARAMETERS, _BUFFERS)):
            found = map(dict.get, map(slots, self.owners[kind]), self.keys[kind])
            if not all(map(is_, found, self.tensors[kind])):
                return False
        return self._addresses() == self.addresses


_PARAMETERS = attrgetter("_parameters")
_BUFFERS = attrgetter("_buffers")


@attrs.frozen(eq=False)
class PreparedBatch:
    """``tensors[k]`` is manifest entry ``indices[k]``; ``groups``: the ``(destinations, sources)``
    lists of each copy launch of an in-place module write (None: no precomputed write), valid
    while the applier's destinations are those of ``generation``."""

    manifest: tuple[TensorSpec, ...]
    indices: tuple[int, ...]
    tensors: list[torch.Tensor]
    groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None
    generation: int = 0


@attrs.define
class _Session:
    manifest: tuple[TensorSpec, ...]
    index: dict[str, int]  # name -> position in the manifest
    dests: list[torch.Tensor] | None  # the module tensor each manifest entry is written into
    sizes: tuple[int, ...]  # bytes of each manifest entry
    received: bytearray
    order: list[int] = attrs.field(factory=list)  # manifest positions, in arrival order
    staged: dict[int, torch.Tensor] = attrs.field(factory=dict)
    num_bytes: int = 0
    started: float = attrs.field(factory=time.monotonic)
    external: bool = False  # one-pass: the sender writes the whole version, nothing is applied


class WeightApplier:
    """Validate-then-write of refit batches into a module or a ``load_weights`` callable."""

    def __init__(
        self, target: nn.Module | LoadWeights, refit_info: Mapping[str, Any], *, atomic: bool
    ) -> None:
        self.expected = expected_from_refit_info(refit_info)
        self._module: nn.Module | None = None
        self._where: _Where | None = None  # where its tensors were at the last bind
        self._generation = 0  # bumped each time the destinations are found again
        if isinstance(target, nn.Module):
            self._dests: dict[str, torch.Tensor] | None = _module_destinations(
                target, self.expected
            )
            self._module, self._where = target, _Where(target)
            self._load: LoadWeights | None = None
        elif callable(target):
            self._dests, self._load = None, target
        else:
            msg = (
                "target must be an nn.Module or a load_weights(iterable) callable, got "
                f"{type(target).__name__}"
            )
            raise ValueError(msg)
        self.atomic = atomic
        self.version = 0
        self.stale = False
        self._session: _Session | None = None
        # the last accepted manifest object and what was derived from it (checked once per object)
        self._accepted: tuple[TensorSpec, ...] | None = None
        self._index: dict[str, int] = {}
        self._sizes: tuple[int, ...] = ()
        self._names: tuple[str, ...] = ()
        self._total_bytes = 0
        self._dest_list: list[torch.Tensor] | None = None

    def rebind(self, target: nn.Module) -> None:
        """Find the module's destinations again (its weights moved, e.g. into a one-pass arena).

        Raises:
            ValueError: a refit is in progress, or the module no longer holds a destination.
        """
        if self._session is not None:
            msg = "rebind during a refit: finish or abort it first"
            raise ValueError(msg)
        self._dests = _module_destinations(target, self.expected)
        self._module, self._where = target, _Where(target)
        self._generation += 1  # prepared copy groups hold the old destinations
        self._accepted, self._dest_list = None, None  # derived from the old destinations

    @property
    def generation(self) -> int:
        """Bumped whenever the destinations are found again: batches prepared before are stale."""
        return self._generation

    def module_moved(self) -> bool:
        """Whether the module target's tensors were re-pointed since the last bind (a
        ``load_state_dict(assign=True)`` puts new tensor objects in place of the bound ones)."""
        if self._module is None:
            return False
        assert self._where is not None
        return not self._where.holds(self._module)

    def _follow_module(self) -> None:
        """Find the destinations again when the module's tensors were re-pointed since the
        last bind: a refit written into the old storage would report success and change
        nothing. ``ProtocolError`` naming what the module no longer holds."""
        if self._module is None or not self.module_moved():
            return
        try:
            self.rebind(self._module)
        except ValueError as exc:
            msg = f"the target module's parameters were re-pointed and no longer fit: {exc}"
            raise ProtocolError(msg) from None

    def destinations(self) -> dict[str, torch.Tensor] | None:
        """The live tensor each refit name is written into (None for a ``load_weights`` target)."""
        return None if self._dests is None else dict(self._dests)

    def expect_external_write(self) -> None:
        """The refit in progress is written by the sender straight into the destinations
        (one-pass): nothing is applied here, and an in-place receiver is ``stale`` from now
        until ``commit`` (an atomic one's sender writes a spare copy, so it stays fresh)."""
        session = self._require_session()
        session.external = True
        if not self.atomic:
            self.stale = True

    def manifest_specs(self) -> list[TensorSpec]:
        """The manifest ``refit_info`` announces (what a sender's BEGIN should carry)."""
        return [
            TensorSpec(name, tuple(shape), dtype) for name, (shape, dtype) in self.expected.items()
        ]

    def begin(self, manifest: Sequence[TensorSpec], *, located: bool = False) -> None:
        """Start a refit of ``manifest`` (checked against ``refit_info`` once per manifest
        object). ``located``: the caller has just made sure the module's tensors were not
        re-pointed (a one-pass BEGIN asks its arena, which rebinds this applier if they were),
        so the module is not walked a second time."""
        if self._session is not None:
            self.abort("a new refit began before the previous one completed")
        if not located:
            self._follow_module()
        if manifest is not self._accepted:
            specs = tuple(manifest)
            problems = check_manifest(specs, self.expected)
            if problems:
                raise ProtocolError("manifest rejected before any write: " + " | ".join(problems))
            # the ZMQ server hands the same tuple object for a byte-identical manifest
            self._accepted = manifest if isinstance(manifest, tuple) else None
            self._index = {s.name: i for i, s in enumerate(specs)}
            self._sizes = tuple(s.nbytes for s in specs)
            self._names, self._total_bytes = tuple(s.name for s in specs), sum(self._sizes)
            self._dest_list = None if self._dests is None else [self._dests[s.name] for s in specs]
            manifest = specs
        self._session = _Session(
            tuple(manifest), self._index, self._dest_list, self._sizes, bytearray(len(manifest))
        )

    def apply_batch(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Check named tensors against the manifest (all of them first), then write them."""
        session = self._require_session()
        problems, seen, indices = [], set(), []
        for name, tensor in pairs:
            index = session.index.get(name)
            if index is None:
                problems.append(f"unexpected name {name!r}")
                continue
            want = session.manifest[index]
            if session.received[index] or index in seen:
                problems.append(f"duplicate name {name!r}")
            elif tuple(tensor.shape) != want.shape or tensor.dtype != want.dtype:
                problems.append(
                    f"{name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, manifest says "
                    f"{dtype_name(want.dtype)}{list(want.shape)}"
                )
            seen.add(index)
            indices.append(index)
        if problems:
            raise ProtocolError("batch rejected before any write: " + "; ".join(problems[:20]))
        self._apply(session, indices, [t for _, t in pairs])

    def apply_indexed(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Write ``tensors[k]`` as manifest entry ``indices[k]``: views built from the manifest's
        own specs (the ZMQ server's path, after ``check_bucket``); indices are checked again."""
        session = self._require_session()
        self._check_indices(session, indices)
        self._apply(session, indices, tensors)

    def prepare(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> PreparedBatch:
        """A reusable ``apply_indexed`` of these exact tensors (the ZMQ server caches one per kept
        bucket): in-place module writes get their copy groups computed once."""
        session = self._require_session()
        groups = None
        if not self.atomic and session.dests is not None:
            dests = session.dests
            groups = copy_groups([dests[i] for i in indices], tensors)
        return PreparedBatch(
            session.manifest, tuple(indices), list(tensors), groups, self._generation
        )

    def apply_prepared(self, batch: PreparedBatch) -> None:
        """``apply_indexed(batch.indices, batch.tensors)``, with the precomputed copy groups."""
        session = self._require_session()
        if (
            batch.groups is None
            or batch.manifest is not session.manifest
            or batch.generation != self._generation
            or self.atomic
        ):
            self.apply_indexed(batch.indices, batch.tensors)
            return
        self._check_indices(session, batch.indices)
        self.stale = True
        with torch.no_grad():
            run_copy_groups(batch.groups)
        self._mark(session, batch.indices)

    def _check_indices(self, session: _Session, indices: Sequence[int]) -> None:
        count, received = len(session.manifest), session.received
        if len(set(indices)) != len(indices) or not all(
            0 <= i < count and not received[i] for i in indices
        ):
            raise ProtocolError(
                "batch rejected before any write: an index is out of range or repeated"
            )

    def _mark(self, session: _Session, indices: Sequence[int]) -> None:
        received = session.received
        for index in indices:
            received[index] = 1
        session.order.extend(indices)
        sizes = session.sizes
        session.num_bytes += sum(sizes[i] for i in indices)

    def _apply(
        self, session: _Session, indices: Sequence[int], tensors: Sequence[torch.Tensor]
    ) -> None:
        with torch.no_grad():
            if self.atomic:
                for index, tensor in zip(indices, tensors, strict=True):
                    like = session.dests[index] if session.dests is not None else tensor
                    staged = torch.empty(like.shape, dtype=like.dtype, device=like.device)
                    session.staged[index] = staged.copy_(tensor)
            else:
                self.stale = True
                self._write(session, indices, tensors)
        self._mark(session, indices)

    def _write(
        self, session: _Session, indices: Sequence[int], tensors: Sequence[torch.Tensor]
    ) -> None:
        if session.dests is not None:
            # grouped launches for the whole batch: per-tensor launch overhead dominates
            # small tensors
            dests = session.dests
            grouped_copy_([dests[i] for i in indices], tensors)
        else:
            assert self._load is not None
            manifest = session.manifest
            self._load([(manifest[i].name, t) for i, t in zip(indices, tensors, strict=True)])

    def commit(self, *, num_buckets: int = 0) -> RefitReport:
        session = self._require_session()
        if session.external and not session.order and session.manifest is self._accepted:
            # The sender wrote every entry, in manifest order, and none was applied here: the
            # report is this manifest's, derived once when it was accepted (a one-pass refit
            # would otherwise walk every entry again here, after its writes are done).
            return self._committed(session, self._names, self._total_bytes, num_buckets)
        if session.external:  # every entry was written by the sender, none applied here
            self._mark(session, [i for i, got in enumerate(session.received) if not got])
        if len(session.order) != len(session.manifest):
            missing = [
                s.name for s, got in zip(session.manifest, session.received, strict=True) if not got
            ]
            raise ProtocolError(
                f"refit incomplete: {len(missing)} tensors never arrived: {missing[:20]}"
            )
        if self.atomic and not session.external:
            with torch.no_grad():
                self._write(session, session.order, [session.staged[i] for i in session.order])
        names = tuple(session.manifest[i].name for i in session.order)
        return self._committed(session, names, session.num_bytes, num_buckets)

    def _committed(
        self, session: _Session, names: tuple[str, ...], num_bytes: int, num_buckets: int
    ) -> RefitReport:
        """End ``session`` as the new version."""
        self._session = None
        self.version += 1
        self.stale = False
        return RefitReport(
            self.version,
            names,
            len(names),
            num_bytes,
            num_buckets,
            time.monotonic() - session.started,
        )

    def abort(self, reason: str) -> None:
        """Drop the refit in progress; in-place mode stays ``stale`` if anything was written."""
        del reason  # the caller reports it; nothing here depends on why
        self._session = None

    def _require_session(self) -> _Session:
        if self._session is None:
            raise ProtocolError("no refit in progress: call begin (BEGIN) first")
        return self._session


def specs_from(manifest: Mapping[str, Any] | Sequence[TensorSpec]) -> list[TensorSpec]:
    if isinstance(manifest, Mapping):
        return [TensorSpec(name, tuple(shape), dtype) for name, (shape, dtype) in manifest.items()]
    return list(manifest)

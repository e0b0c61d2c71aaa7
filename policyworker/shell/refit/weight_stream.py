"""The refit parameter stream: HF-named, dtype-correct tensors of a (possibly sharded) model.

One code path feeds every transport and the refit metadata (``prepare_refit_info``):

``iter_refit_sources`` walks ``model.state_dict()`` in order (parameters and persistent
buffers), gathers DTensors, merges LoRA into its base weight (after checking every LoRA module is
reachable), strips wrapper prefixes, drops a tied ``lm_head.weight``, renames and cuts each
tensor into what ``save_pretrained`` writes (the layout transformers gives,
``hf_names.checkpoint_layout``: e.g. fused MoE experts → per-expert views; an unsupported
``model_type`` is refused there), and picks each tensor's refit dtype — yielding the
*uncast* source with that dtype, so a transport can cast straight into its staging buffer. Then
the draft model's tensors follow as ``draft.<name>``.

``params_generator`` casts and makes each tensor contiguous; ``refit_info`` records the same
walk's ``(shape, dtype)`` (no gather, no copy).

The per-key decisions (names, dtypes, LoRA merges, checkpoint pieces) are compiled once per model
over meta stand-ins and cached while the model's ``state_dict`` keys, shapes and dtypes are
unchanged, so a refit costs one ``state_dict`` walk plus one pass over the live tensors
(``refit_stream`` hands a transport the specs and the sources of that single walk). That walk is
``live_state_dict``: torch's ``state_dict(keep_vars=True)`` read straight from the modules
while none customises its state dict.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import attrs
import torch
from torch import nn

from policyworker.functional.buckets import TensorSpec
from policyworker.functional.dtypes import refit_tensor_dtype
from policyworker.functional.lora import assert_lora_modules_reachable, merge_lora_weight
from policyworker.functional.names import (
    CheckpointPiece,
    canonical_name,
    is_lora_param,
    to_checkpoint,
)
from policyworker.shell.refit.hf_names import checkpoint_layout
from policyworker.shell.refit.live_state import StateReader, live_state_dict

__all__ = [
    "DRAFT_PREFIX",
    "PLAIN_TENSOR_TYPES",
    "RefitSource",
    "RefitStream",
    "iter_refit_sources",
    "keep_fp32_patterns",
    "params_generator",
    "plain_tensors",
    "refit_info",
    "refit_specs",
    "refit_stream",
]

DRAFT_PREFIX = "draft."


class RefitSource(NamedTuple):
    """One tensor of the refit stream before its cast: the HF name, the source, the wire dtype.

    A named tuple rather than a frozen attrs class: one is made per tensor per refit, and a
    frozen attrs instance costs about three times as much to build (its fields are set through
    ``object.__setattr__``), which showed in the one-pass refit's per-tensor host time.
    """

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, tuple(self.tensor.shape), self.dtype)


def keep_fp32_patterns(model: nn.Module) -> tuple[str, ...]:
    """The model's ``_keep_in_fp32_modules`` + ``_keep_in_fp32_modules_strict`` (refit sends
    those fp32 tensors as fp32)."""
    patterns: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        patterns.extend(getattr(model, attr, None) or ())
    return tuple(patterns)


def tie_word_embeddings(model: nn.Module) -> bool:
    """Whether the model's (text) config ties lm_head to the input embeddings."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def _lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """LoRA-wrapped linears, duck-typed (``lora_A``, ``lora_B``, ``scale``), by raw module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if all(hasattr(module, attr) for attr in ("lora_A", "lora_B", "scale"))
    }


def _materialize(tensor: torch.Tensor, *, meta: bool) -> torch.Tensor:
    """The full (unsharded) tensor, or a meta stand-in of its global shape and dtype."""
    tensor = tensor.detach()
    if meta:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    full_tensor = getattr(tensor, "full_tensor", None)  # DTensor: a collective on every rank
    return full_tensor() if full_tensor is not None else tensor


@attrs.frozen(eq=False)
class _Entry:
    """One state-dict key of a compiled walk: what it becomes on the wire."""

    key: str  # the raw state-dict key
    name: str  # canonical name (wrappers stripped)
    lora: str | None  # raw name of the LoRA module merged into this weight, if any
    # the checkpoint views cut from it (None: sent whole, under outputs[0]'s name)
    pieces: tuple[CheckpointPiece, ...] | None
    outputs: tuple[TensorSpec, ...]  # (prefixed checkpoint name, shape, wire dtype) per piece


@attrs.frozen(eq=False)
class _Walk:
    """The refit walk of one model, compiled from its state-dict signature (identity-compared)."""

    signature: tuple[tuple[str, torch.Size, torch.dtype], ...]
    entries: tuple[_Entry, ...]
    specs: tuple[TensorSpec, ...]
    # the state-dict key of each spec when every entry is sent whole and unmerged, else None
    whole_keys: tuple[str, ...] | None = None

    def matches(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Same keys, shapes and dtypes in the same order (about 1 µs per tensor)."""
        sig = self.signature
        return len(state) == len(sig) and all(
            k == ck and v.shape == cs and v.dtype == cd
            for (k, v), (ck, cs, cd) in zip(state.items(), sig, strict=True)
        )


# model -> {(target dtype, keep_fp32, prefix, tied): walk}; entries die with their model
_WALKS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], _Walk]] = (
    weakref.WeakKeyDictionary()
)


def _compile_walk(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    target_dtype: torch.dtype,
    *,
    keep_fp32: tuple[str, ...],
    prefix: str,
    tied: bool,
) -> _Walk:
    """Names, dtypes and LoRA/layout handling of every key, decided once over meta stand-ins."""
    lora = _lora_modules(model)
    if lora:
        assert_lora_modules_reachable(lora, state.keys())
    kept: list[tuple[str, str, torch.Tensor]] = []  # (key, canonical name, meta stand-in)
    for key, value in state.items():
        name = canonical_name(key)
        if is_lora_param(key) or (tied and name == "lm_head.weight"):
            continue
        # a merged LoRA weight keeps W's shape and dtype
        kept.append((key, name, _materialize(value, meta=True)))
    layout = checkpoint_layout(model, {name: meta.shape for _, name, meta in kept})
    entries: list[_Entry] = []
    for key, name, meta in kept:
        pieces = layout[name]
        split = not (len(pieces) == 1 and pieces[0].is_whole(meta.shape))
        outputs = tuple(
            # keep_fp32 patterns name the in-memory modules, so they match the in-memory name
            TensorSpec(
                prefix + piece.name,
                piece.shape,
                refit_tensor_dtype(name, piece.view_of(meta), target_dtype, keep_fp32=keep_fp32),
            )
            for piece in pieces
        )
        base = key.removesuffix(".weight") if key.endswith(".weight") else None
        entries.append(
            _Entry(key, name, base if base in lora else None, pieces if split else None, outputs)
        )
    signature = tuple((k, v.shape, v.dtype) for k, v in state.items())
    whole = all(e.lora is None and e.pieces is None for e in entries)
    return _Walk(
        signature,
        tuple(entries),
        tuple(s for e in entries for s in e.outputs),
        tuple(e.key for e in entries) if whole else None,
    )


def _walk_of(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    target_dtype: torch.dtype,
    *,
    keep_fp32: tuple[str, ...],
    prefix: str,
) -> _Walk:
    """The cached walk while the model's key/shape/dtype signature is unchanged, else a new one."""
    tied = tie_word_embeddings(model)
    cache_key = (target_dtype, keep_fp32, prefix, tied)
    per_model = _WALKS.setdefault(model, {})
    walk = per_model.get(cache_key)
    if walk is None or not walk.matches(state):
        walk = _compile_walk(
            model, state, target_dtype, keep_fp32=keep_fp32, prefix=prefix, tied=tied
        )
        per_model[cache_key] = walk
    return walk


def _iter_walk(
    model: nn.Module, state: Mapping[str, torch.Tensor], walk: _Walk
) -> Iterator[RefitSource]:
    for entry in walk.entries:
        # _materialize(..., meta=False) inlined: this loop runs once per tensor per refit
        full = state[entry.key].detach()
        gather = getattr(full, "full_tensor", None)  # DTensor: a collective on every rank
        if gather is not None:
            full = gather()
        if entry.lora is not None:  # merged weight has W's shape and dtype by contract
            # Any: a LoRA module is any class with lora_A, lora_B and scale (duck-typed on purpose).
            module = cast(Any, model.get_submodule(entry.lora))
            lora_a = _materialize(module.lora_A.weight, meta=False)
            lora_b = _materialize(module.lora_B.weight, meta=False)
            full = merge_lora_weight(full, lora_a, lora_b, float(module.scale))
        if entry.pieces is not None:
            views = to_checkpoint(full, entry.pieces)
            for spec, (_, view) in zip(entry.outputs, views, strict=True):
                yield RefitSource(spec.name, view, spec.dtype)
        else:
            spec = entry.outputs[0]
            yield RefitSource(spec.name, full, spec.dtype)


@attrs.frozen(eq=False)
class RefitStream:
    """One refit's stream from a single state-dict walk per model.

    ``specs``: the wire specs in send order (cached: the same tuple object while the models'
    signatures are unchanged). ``key``: equal (``==``) between two calls exactly when their
    compiled walks are the same objects, so a transport may reuse a bucket plan made for ``specs``.
    ``sources``: the uncast live tensors, lazily (DTensor gathers happen while iterating).
    ``plain``: when every source is a whole live tensor of a plain class (no gather, no LoRA
    merge, no checkpoint piece), those tensors themselves, in spec order, each of its spec's
    shape; a transport may then copy them in grouped launches, under ``torch.no_grad`` (they
    are not detached), instead of iterating ``sources``, which it then leaves to its owner to
    close. None otherwise.
    """

    specs: tuple[TensorSpec, ...]
    key: tuple[Any, ...]
    sources: Generator[RefitSource, None, None]  # close it when stopping early
    plain: Sequence[torch.Tensor] | None = None


# The classes a `plain` source may have: a DTensor (or any other subclass) is read another way.
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, nn.Parameter})


def plain_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``tensors`` when every one is of a `PLAIN_TENSOR_TYPES` class, else None."""
    return tensors if all(type(t) in PLAIN_TENSOR_TYPES for t in tensors) else None


def _models(
    model: nn.Module, draft_model: nn.Module | None, keep_fp32: Sequence[str] | None
) -> list[tuple[nn.Module, tuple[str, ...], str]]:
    keep = keep_fp32_patterns(model) if keep_fp32 is None else tuple(keep_fp32)
    out = [(model, keep, "")]
    if draft_model is not None:
        out.append((draft_model, keep_fp32_patterns(draft_model), DRAFT_PREFIX))
    return out


def refit_stream(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
    reader: StateReader | None = None,
) -> RefitStream:
    """Specs and live sources of one refit from one ``state_dict`` walk per model (``reader``:
    the caller's ``StateReader``, kept across its refits).

    The names, dtypes, LoRA merges and expert splits are compiled once per model and reused
    while the model's ``state_dict`` keys, shapes and dtypes are unchanged (checked every call,
    about 1 µs per tensor); any change (a reload, new LoRA adapters, a resized vocab) recompiles.
    """
    parts = []
    for module, keep, prefix in _models(model, draft_model, keep_fp32):
        state = live_state_dict(module, reader)
        parts.append(
            (module, state, _walk_of(module, state, target_dtype, keep_fp32=keep, prefix=prefix))
        )
    walks = tuple(w for _, _, w in parts)
    specs = walks[0].specs if len(walks) == 1 else _joined_specs(walks)

    # No ``torch.no_grad()`` around the yields: grad mode is thread state, and a generator left
    # suspended inside one (a refit that fails midway) would leave autograd off in the caller's
    # thread. Every source is detached (``_materialize``), so nothing here records a graph.
    def sources() -> Generator[RefitSource, None, None]:
        for module, state, walk in parts:
            yield from _iter_walk(module, state, walk)

    plain = None
    if all(walk.whole_keys is not None for walk in walks):
        plain = plain_tensors(
            [state[key] for _, state, walk in parts for key in walk.whole_keys or ()]
        )
    return RefitStream(specs, walks, sources(), plain)


_JOINED: dict[tuple[_Walk, ...], tuple[TensorSpec, ...]] = {}


def _joined_specs(walks: tuple[_Walk, ...]) -> tuple[TensorSpec, ...]:
    """The concatenated specs of several walks, one tuple object per combination of walks."""
    joined = _JOINED.get(walks)
    if joined is None:
        _JOINED.clear()  # keep only the latest combination alive
        joined = _JOINED[walks] = tuple(s for w in walks for s in w.specs)
    return joined


def iter_refit_sources(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
    meta: bool = False,
) -> Iterator[RefitSource]:
    """Uncast refit sources in send order; ``meta=True`` yields meta stand-ins (for metadata).

    Every rank of a sharded model must iterate this together (DTensor gathers are collective).
    """
    stream = refit_stream(model, target_dtype, draft_model, keep_fp32=keep_fp32)
    if not meta:
        yield from stream.sources
        return
    for spec in stream.specs:
        yield RefitSource(
            spec.name, torch.empty(spec.shape, dtype=spec.dtype, device="meta"), spec.dtype
        )


def params_generator(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs in send order, each cast to its refit dtype and contiguous."""
    for source in iter_refit_sources(model, target_dtype, draft_model, keep_fp32=keep_fp32):
        yield source.name, source.tensor.to(source.dtype).contiguous()


def refit_specs(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
) -> list[TensorSpec]:
    """The wire specs of the stream (same walk as ``params_generator``, over meta tensors)."""
    return list(refit_stream(model, target_dtype, draft_model, keep_fp32=keep_fp32).specs)


def refit_info(
    model: nn.Module,
    target_dtype: torch.dtype,
    draft_model: nn.Module | None = None,
    *,
    keep_fp32: Sequence[str] | None = None,
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{hf_name: (shape, dtype)}`` in send order: exactly what ``params_generator`` sends."""
    specs = refit_specs(model, target_dtype, draft_model, keep_fp32=keep_fp32)
    return {s.name: (torch.Size(s.shape), s.dtype) for s in specs}

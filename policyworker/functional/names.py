"""Parameter names: wrapper prefixes, LoRA names, and the HF checkpoint layout of tensors.

A checkpoint tensor is described as a ``CheckpointPiece``: a strided view (shape, stride,
offset) of one contiguous in-memory tensor. The shell asks transformers for a model's pieces
(``policyworker.shell.refit.hf_names``); the functions here apply them (``to_checkpoint``),
invert them (``from_checkpoint``, ``pieces_by_checkpoint_name``) and check them
(``check_pieces``).

All functions are pure.
"""

import math
import re
from collections.abc import Mapping, Sequence

import attrs
import torch

__all__ = [
    "CheckpointPiece",
    "canonical_name",
    "check_pieces",
    "contiguous_strides",
    "drop_tied_lm_head",
    "from_checkpoint",
    "is_lora_param",
    "lora_base_name",
    "lora_module_name",
    "pieces_by_checkpoint_name",
    "to_checkpoint",
    "whole_piece",
]

_WRAPPER_FRAGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_LORA_RE = re.compile(r"^(?P<module>.+)\.lora_[AB](\.|$)")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The element strides of a contiguous tensor of ``shape``."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


@attrs.frozen
class CheckpointPiece:
    """One checkpoint tensor: ``name`` and where it lies in its contiguous in-memory tensor.

    The tensor is ``source.as_strided(shape, stride, offset)`` (element units, offset relative
    to the source's first element); a piece that is the whole source has ``offset`` 0 and the
    contiguous strides of the source's shape.
    """

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_whole(self, source_shape: Sequence[int]) -> bool:
        """True when this piece is all of a source of ``source_shape``, in its own layout."""
        shape = tuple(int(s) for s in source_shape)
        return self.offset == 0 and self.shape == shape and self.stride == contiguous_strides(shape)

    def view_of(self, source: torch.Tensor) -> torch.Tensor:
        """This piece of ``source`` (a view, writable).

        Raises:
            ValueError: ``source`` is not contiguous (the strides are those of a contiguous one).
        """
        if not source.is_contiguous():
            msg = (
                f"checkpoint piece {self.name!r} needs a contiguous source tensor (got strides "
                f"{source.stride()}); call .contiguous() first"
            )
            raise ValueError(msg)
        return source.as_strided(self.shape, self.stride, source.storage_offset() + self.offset)


def whole_piece(name: str, shape: Sequence[int]) -> CheckpointPiece:
    """The piece that is a whole tensor of ``shape``, saved under ``name``."""
    shape = tuple(int(s) for s in shape)
    return CheckpointPiece(name, shape, contiguous_strides(shape), 0)


def check_pieces(
    source_name: str, source_shape: Sequence[int], pieces: Sequence[CheckpointPiece]
) -> None:
    """Raise ValueError unless ``pieces`` lie inside the source and hold as many elements.

    Together with distinct element sets (which the caller's derivation guarantees: they are
    views cut by transformers' conversion) this means the pieces tile the source exactly.
    """
    numel = math.prod(int(s) for s in source_shape)
    if not pieces:
        msg = f"{source_name!r} has no checkpoint piece; every in-memory tensor must be saved"
        raise ValueError(msg)
    for piece in pieces:
        reach = sum((n - 1) * st for n, st in zip(piece.shape, piece.stride, strict=True))
        last = piece.offset + reach
        if piece.numel and (piece.offset < 0 or last >= numel or min(piece.stride, default=0) < 0):
            msg = (
                f"checkpoint piece {piece.name!r} (shape {list(piece.shape)}, stride "
                f"{list(piece.stride)}, offset {piece.offset}) reaches outside {source_name!r} "
                f"of shape {list(source_shape)}"
            )
            raise ValueError(msg)
    total = sum(p.numel for p in pieces)
    if total != numel:
        msg = (
            f"the checkpoint pieces of {source_name!r} hold {total} elements, the tensor has "
            f"{numel}: its checkpoint conversion drops or repeats elements; refit cannot "
            f"stream it as views"
        )
        raise ValueError(msg)


def to_checkpoint(
    source: torch.Tensor, pieces: Sequence[CheckpointPiece]
) -> list[tuple[str, torch.Tensor]]:
    """``(checkpoint name, view)`` of each piece of ``source`` (no copy when it is contiguous)."""
    source = source.contiguous()
    return [(piece.name, piece.view_of(source)) for piece in pieces]


def from_checkpoint(
    source_shape: Sequence[int],
    pieces: Sequence[CheckpointPiece],
    tensors: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """The in-memory tensor rebuilt from its checkpoint tensors (inverse of ``to_checkpoint``).

    Raises:
        ValueError: a piece's tensor is missing or has another shape.
    """
    missing = [p.name for p in pieces if p.name not in tensors]
    if missing:
        msg = f"cannot rebuild a tensor of shape {list(source_shape)}: missing {missing}"
        raise ValueError(msg)
    first = tensors[pieces[0].name]
    out = torch.empty(tuple(source_shape), dtype=first.dtype, device=first.device)
    for piece in pieces:
        given = tensors[piece.name]
        if tuple(given.shape) != piece.shape:
            msg = (
                f"checkpoint tensor {piece.name!r} has shape {list(given.shape)}, its piece "
                f"says {list(piece.shape)}"
            )
            raise ValueError(msg)
        piece.view_of(out).copy_(given)
    return out


def pieces_by_checkpoint_name(
    layout: Mapping[str, Sequence[CheckpointPiece]],
) -> dict[str, tuple[str, CheckpointPiece]]:
    """``{checkpoint name: (in-memory name, piece)}`` of a layout ``{in-memory name: pieces}``.

    Raises:
        ValueError: two pieces share a checkpoint name.
    """
    out: dict[str, tuple[str, CheckpointPiece]] = {}
    for source, pieces in layout.items():
        for piece in pieces:
            if piece.name in out:
                msg = (
                    f"checkpoint name {piece.name!r} comes from both {out[piece.name][0]!r} and "
                    f"{source!r}; a checkpoint name must have one source"
                )
                raise ValueError(msg)
            out[piece.name] = (source, piece)
    return out


def canonical_name(fqn: str) -> str:
    """``fqn`` without wrapper fragments or ``module.``.

    The fragments are those torch.compile, activation checkpointing and FSDP insert.
    """
    for fragment in _WRAPPER_FRAGMENTS:
        fqn = fqn.replace(fragment, "")
    return fqn.removeprefix("module.")


def is_lora_param(fqn: str) -> bool:
    """True for the LoRA adapter tensors (``.lora_A.`` / ``.lora_B.`` fragments)."""
    return _LORA_RE.match(fqn) is not None


def lora_module_name(fqn: str) -> str:
    """The LoRA-wrapped module of an adapter tensor: ``a.b.lora_A.weight`` → ``a.b``.

    Raises:
        ValueError: ``fqn`` is not a LoRA adapter name.
    """
    match = _LORA_RE.match(fqn)
    if match is None:
        msg = (
            f"{fqn!r} is not a LoRA adapter name "
            "(expected '<module>.lora_A.*' or '<module>.lora_B.*')"
        )
        raise ValueError(msg)
    return match["module"]


def lora_base_name(fqn: str) -> str:
    """The base weight a LoRA adapter tensor merges into: ``a.b.lora_B.weight`` → ``a.b.weight``."""
    return f"{lora_module_name(fqn)}.weight"


def drop_tied_lm_head(names: Sequence[str], *, tie_word_embeddings: bool) -> list[str]:
    """``names`` without ``lm_head.weight`` when the embeddings are tied.

    This matches what ``save_pretrained`` writes.
    """
    if not tie_word_embeddings:
        return list(names)
    return [n for n in names if n != "lm_head.weight"]

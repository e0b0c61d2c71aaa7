# pyright: basic
"""The one-pass registration on the wire: where a receiver's weights live, as JSON + handles.

A receiver that registered for one-pass refits answers a one-pass BEGIN with its
``Registration``: the id, the arena (a /dev/shm file or a CUDA allocation, described like a
staging buffer), the spare arena of an atomic receiver, and one ``Destination`` per manifest
name. A sender that already holds that id gets ``{"id": ...}`` only. Decoding type-checks every
field and never evaluates anything; what the destinations mean is checked by the sender with
``functional.arena.destination_problems`` before it writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from policyworker.functional.arena import Destination
from policyworker.functional.wire.checks import self_overlap_problem
from policyworker.functional.wire.codec import (
    DTYPES_BY_NAME,
    CudaBuffer,
    ProtocolError,
    ShmBuffer,
    decode_buffer,
    dtype_name,
    encode_buffer,
)
from policyworker.functional.wire.messages import MAX_DIM, MAX_NAME_CHARS, MAX_NDIM, MAX_TENSORS

__all__ = ["Registration", "decode_registration", "encode_registration"]

_MAX_ID_CHARS = 80
_MAX_OFFSET = 1 << 62


@attrs.frozen
class Registration:
    """A receiver's registered memory. ``spare``: an atomic receiver's second arena, which the
    sender writes and the receiver copies into ``arena`` on COMPLETE (None: write ``arena``)."""

    id: str
    arena: ShmBuffer | CudaBuffer
    spare: ShmBuffer | CudaBuffer | None
    arena_bytes: int
    destinations: tuple[Destination, ...]

    @property
    def write_target(self) -> ShmBuffer | CudaBuffer:
        """The buffer the sender writes."""
        return self.arena if self.spare is None else self.spare


def encode_registration(
    registration: Registration, *, held_id: str | None
) -> tuple[dict[str, Any], list[bytes]]:
    """The ACK's ``registration`` object and raw frames; the id alone when ``held_id`` is it."""
    if held_id == registration.id:
        return {"id": registration.id}, []
    arena, raw = encode_buffer(registration.arena)
    spare = None
    if registration.spare is not None:
        spare, spare_raw = encode_buffer(registration.spare)
        raw = raw + spare_raw
    destinations = [
        [d.name, dtype_name(d.dtype), list(d.shape), list(d.strides), d.offset_bytes]
        for d in registration.destinations
    ]
    body = {
        "id": registration.id,
        "arena_bytes": registration.arena_bytes,
        "arena": arena,
        "spare": spare,
        "destinations": destinations,
    }
    return body, raw


def _fail(reason: str) -> ProtocolError:
    return ProtocolError(f"one-pass registration: {reason}")


def _ints(value: Any, what: str, *, limit: int) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_NDIM
        or not all(type(v) is int and 0 <= v <= limit for v in value)
    ):
        raise _fail(f"{what} must be a list of at most {MAX_NDIM} ints in [0, {limit}]")
    return tuple(value)


def _destination(item: Any, where: str) -> Destination:
    if not isinstance(item, list) or len(item) != 5:
        raise _fail(f"{where} must be [name, dtype, shape, strides, offset], got {item!r:.80}")
    name, dtype, shape, strides, offset = item
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise _fail(f"{where}: the name must be a non-empty string, got {name!r:.80}")
    if not isinstance(dtype, str) or dtype not in DTYPES_BY_NAME:
        raise _fail(f"{where} ({name!r}): unknown dtype {dtype!r:.40}")
    shape_t = _ints(shape, f"{where} ({name!r}) shape", limit=MAX_DIM)
    strides_t = _ints(strides, f"{where} ({name!r}) strides", limit=_MAX_OFFSET)
    if len(strides_t) != len(shape_t) or type(offset) is not int or not 0 <= offset < _MAX_OFFSET:
        raise _fail(f"{where} ({name!r}): one stride per dimension and an offset >= 0")
    overlap = self_overlap_problem(name, shape_t, strides_t)
    if overlap is not None:
        raise _fail(f"{where}: {overlap}")
    return Destination(name, DTYPES_BY_NAME[dtype], shape_t, strides_t, offset)


def _buffer(value: Any, raw: list[bytes], what: str) -> ShmBuffer | CudaBuffer:
    """Decode one buffer object, taking its raw frames (four for CUDA) off the front of ``raw``."""
    kind = value.get("kind") if isinstance(value, dict) else None
    count = 4 if kind == "cuda" else 0
    if len(raw) < count:
        raise _fail(f"the {what} is a CUDA buffer but its handle frames are missing")
    frames, raw[:] = raw[:count], raw[count:]
    try:
        return decode_buffer({"buffer": value}, frames)
    except ProtocolError as exc:
        raise _fail(f"{what}: {exc}") from None


def decode_registration(body: dict[str, Any], raw: Sequence[bytes]) -> Registration | str:
    """The registration of a one-pass ACK, or its id alone (the sender's copy still holds).

    Raises ``ProtocolError`` naming the first bad field.
    """
    reg_id = body.get("id")
    if not isinstance(reg_id, str) or not 0 < len(reg_id) <= _MAX_ID_CHARS:
        raise _fail(f"'id' must be a non-empty string, got {reg_id!r:.80}")
    if set(body) == {"id"}:
        if raw:
            raise _fail("an id-only registration carries no raw frames")
        return reg_id
    arena_bytes = body.get("arena_bytes")
    if type(arena_bytes) is not int or not 0 <= arena_bytes < _MAX_OFFSET:
        raise _fail(f"'arena_bytes' must be an int >= 0, got {arena_bytes!r:.40}")
    frames = list(raw)
    arena = _buffer(body.get("arena"), frames, "arena")
    spare = None if body.get("spare") is None else _buffer(body["spare"], frames, "spare")
    if frames:
        raise _fail(f"{len(frames)} raw frame(s) left over after the arena handles")
    items = body.get("destinations")
    if not isinstance(items, list) or len(items) > MAX_TENSORS:
        raise _fail(f"'destinations' must be a list of at most {MAX_TENSORS} entries")
    destinations = tuple(_destination(item, f"destinations[{i}]") for i, item in enumerate(items))
    return Registration(reg_id, arena, spare, arena_bytes, destinations)

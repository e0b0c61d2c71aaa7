"""The nixl checkpoint engine's control messages as NIXL notification bytes.

A frame is ``MAGIC``, the JSON header's length (4 bytes, big-endian), the header (a JSON object:
``kind``, ``refit``, ...) and a raw payload (a manifest, agent metadata). Decoding never raises:
a notification that is not one of ours decodes to None and is ignored. All functions are pure.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["MAGIC", "NixlFrame", "decode_frame", "encode_frame"]

MAGIC = b"pwnx1"
_LEN = struct.Struct(">I")


@attrs.frozen
class NixlFrame:
    """One decoded control message: its header and raw payload."""

    header: dict[str, Any]
    payload: bytes

    @property
    def kind(self) -> str:
        return str(self.header.get("kind"))


def encode_frame(header: Mapping[str, Any], payload: bytes = b"") -> bytes:
    """The notification bytes of a header (JSON-serializable values) and a payload."""
    raw = json.dumps(dict(header), separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(raw)) + raw + payload


def decode_frame(raw: bytes) -> NixlFrame | None:
    """The frame in a notification, or None for bytes that are not one of ours."""
    start = len(MAGIC) + _LEN.size
    if not raw.startswith(MAGIC) or len(raw) < start:
        return None
    (size,) = _LEN.unpack(raw[len(MAGIC) : start])
    if start + size > len(raw):
        return None
    try:
        header = json.loads(raw[start : start + size])
    except (ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    return NixlFrame(header, raw[start + size :])  # pyright: ignore[reportUnknownArgumentType]

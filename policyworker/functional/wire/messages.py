# pyright: basic
"""The messages of the ZMQ refit protocol as records, and the limits and names they obey.

BEGIN (the manifest and the first staging buffer), BUCKET (tensor indices into that manifest
with byte offsets, and the buffer that carries them), COMPLETE, ABORT and the REPLY to each;
``ShmBuffer`` / ``CudaBuffer`` name a staging buffer. The limits (``MAX_*``) bound what a
decoder accepts, and ``DTYPES_BY_NAME`` is the fixed table of dtypes that may cross the wire.
``wire`` encodes and decodes these records (docs/refit-protocol.md). Every request carries
the id of its refit (``refit``, chosen by the sender at BEGIN) and every reply echoes it with
the request's kind and sequence, so a sender can tell a late answer to an old refit from the
answer it waits for.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import torch

from policyworker.errors import RefitError
from policyworker.functional.buckets import TensorSpec

__all__ = [
    "DTYPES_BY_NAME",
    "MAX_DIM",
    "MAX_HANDLE_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_NAME_CHARS",
    "MAX_NDIM",
    "MAX_REFIT_ID_CHARS",
    "MAX_TENSORS",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "SHM_NAME_RE",
    "Abort",
    "Begin",
    "Bucket",
    "Complete",
    "CudaBuffer",
    "ProtocolError",
    "RefitRejected",
    "RefitRejectedError",
    "Reply",
    "Request",
    "ShmBuffer",
    "dtype_name",
]

PROTOCOL = "policyworker-refit"
PROTOCOL_VERSION = 4
MAX_HANDLE_BYTES = 4096
MAX_HEADER_BYTES = 64 << 20
MAX_NAME_CHARS = 1024
MAX_NDIM = 16
MAX_DIM = 1 << 48
MAX_TENSORS = 1 << 22
MAX_REFIT_ID_CHARS = 64
SHM_NAME_RE = re.compile(r"^pw-refit-[0-9a-f]{8,64}$")
DTYPES_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.complex64,
        torch.complex128,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    )
}


class ProtocolError(RefitError):
    """A message broke the wire format or the manifest; the text is the reason sent to the peer."""


class RefitRejectedError(RefitError):
    """The peer answered with a rejection; the message carries its reason."""


# The public name before the lint pass (N818); callers and tests still import it.
RefitRejected = RefitRejectedError


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype ("bfloat16", "int64", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES_BY_NAME:
        msg = f"dtype {dtype} cannot travel in a refit; supported: {sorted(DTYPES_BY_NAME)}"
        raise ValueError(msg)
    return name


@attrs.frozen
class ShmBuffer:
    """A CPU staging buffer: a file of ``size`` bytes named ``name`` in the shared-memory folder.

    ``keep``: the sender keeps this buffer for its next refit (the receiver may keep its mapping).
    """

    name: str
    size: int
    keep: bool = False


@attrs.frozen
class CudaBuffer:
    """A CUDA staging buffer: the fields of ``UntypedStorage._share_cuda_()`` (handles raw), plus
    ``filled_event``: the IPC handle of the interprocess event the sender records after filling
    the buffer, which the receiver's stream waits on before reading it (no CPU sync)."""

    device_uuid: str
    size: int
    storage_offset_bytes: int
    ref_counter_offset: int
    event_sync_required: bool
    handle: bytes
    ref_counter_handle: bytes
    event_handle: bytes
    filled_event: bytes
    keep: bool = False


@attrs.frozen
class Begin:
    """``one_pass``: None for a staged refit; for a one-pass refit, the id of the receiver's
    registration the sender holds ("" when it holds none). ``or_staged`` (a one-pass BEGIN
    only): a receiver that did not register begins a staged refit instead of refusing, and
    says so by an ACK without a registration (the sender's default, which picks one-pass
    wherever the receiver registered its memory)."""

    rank: int
    transport: str
    alignment: int
    manifest: tuple[TensorSpec, ...]
    one_pass: str | None = None
    refit: str = ""
    or_staged: bool = False


@attrs.frozen
class Bucket:
    """Tensors ``manifest[indices[k]]`` staged at byte ``offsets[k]`` of ``buffer``."""

    seq: int
    buffer: ShmBuffer | CudaBuffer
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    used_bytes: int
    refit: str = ""


@attrs.frozen
class Complete:
    """``one_pass``: the sender wrote every tensor straight into the registered memory;
    ``written_event``: then, on CUDA, the IPC handle of the event it recorded after those writes."""

    num_buckets: int
    one_pass: bool = False
    written_event: bytes = b""
    refit: str = ""


@attrs.frozen
class Abort:
    reason: str
    refit: str = ""


@attrs.frozen
class Reply:
    """The receiver's answer: ``ok`` (an ACK) or a rejection with its ``reason``.

    ``consumed_event``: on a CUDA bucket's ACK, the IPC handle of the receiver's interprocess
    event recorded after its reads of that buffer were queued; the sender's stream waits on it
    before it writes the buffer again (empty otherwise). ``registration``: on the ACK of a
    one-pass BEGIN, where the receiver's weights live (``wire_one_pass``), its raw frames in
    ``registration_frames``. ``reply_to``, ``refit`` and ``seq`` name the request answered:
    its kind, the refit id its BEGIN carried, and its bucket sequence (-1 for the others).
    """

    ok: bool
    reply_to: str
    seq: int = -1
    reason: str = ""
    report: dict[str, Any] = attrs.field(factory=dict)
    consumed_event: bytes = b""
    registration: dict[str, Any] | None = None
    registration_frames: tuple[bytes, ...] = ()
    refit: str = ""

    def answers(self, kind: str, refit: str, seq: int) -> bool:
        """Whether this reply names the request ``(kind, refit, seq)``."""
        return self.reply_to == kind and self.refit == refit and self.seq == seq


Request = Begin | Bucket | Complete | Abort

# pyright: basic
"""The refit wire format: a JSON header frame plus raw binary frames, never pickle.

Encoding and strict decoding of every message of the ZMQ refit protocol (docs/refit-protocol.md),
and the manifest/bucket checks a receiver runs BEFORE it writes anything. Decoding never
evaluates anything: JSON is parsed, every field is type- and range-checked, dtypes come from a
fixed table, and anything else raises ``ProtocolError`` with a reason that is sent back to the
peer.

Version 2: BEGIN carries the manifest once, as its own JSON frame (a receiver given a
``ManifestCache`` reuses its parse of a byte-identical manifest); a BUCKET names its tensors by
their index in that manifest plus a byte offset each (no names, dtypes or shapes repeated), and
its buffer carries ``keep`` (the sender keeps the buffer for the next refit, so the receiver may
keep its mapping).

Version 4 binds replies to requests: every message carries ``refit``, the id the sender chose
at BEGIN, and a reply echoes it with the kind (``reply_to``) and sequence of the request.

One-pass refits add optional fields, so a staged refit's frames are unchanged: BEGIN's
``one_pass`` (the registration id the sender holds), the ACK's ``registration`` (its JSON
and handle frames are read by ``wire_one_pass``) and COMPLETE's ``one_pass`` with its written
event.

The message records and limits live in ``wire_messages`` and the receiver's checks in
``wire_checks``; every name stays importable from here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from policyworker.functional.buckets import TensorSpec
from policyworker.functional.wire.checks import check_bucket, check_manifest
from policyworker.functional.wire.messages import (
    DTYPES_BY_NAME,
    MAX_DIM,
    MAX_HANDLE_BYTES,
    MAX_HEADER_BYTES,
    MAX_NAME_CHARS,
    MAX_NDIM,
    MAX_REFIT_ID_CHARS,
    MAX_TENSORS,
    PROTOCOL,
    PROTOCOL_VERSION,
    SHM_NAME_RE,
    Abort,
    Begin,
    Bucket,
    Complete,
    CudaBuffer,
    ProtocolError,
    RefitRejected,
    RefitRejectedError,
    Reply,
    Request,
    ShmBuffer,
    dtype_name,
)

__all__ = [
    "DTYPES_BY_NAME",
    "MAX_HEADER_BYTES",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "SHM_NAME_RE",
    "Abort",
    "Begin",
    "Bucket",
    "Complete",
    "CudaBuffer",
    "ManifestCache",
    "ProtocolError",
    "RefitRejected",
    "RefitRejectedError",
    "Reply",
    "ShmBuffer",
    "check_bucket",
    "check_manifest",
    "decode_buffer",
    "decode_reply",
    "decode_request",
    "decode_versioned_json",
    "dtype_name",
    "encode",
    "encode_buffer",
    "encode_manifest",
    "max_message_bytes",
]


def _spec_json(spec: TensorSpec) -> list[Any]:
    return [spec.name, dtype_name(spec.dtype), list(spec.shape)]


def encode_manifest(manifest: Sequence[TensorSpec]) -> bytes:
    """The BEGIN message's manifest frame: a JSON list of ``[name, dtype, shape]``."""
    return json.dumps([_spec_json(s) for s in manifest], separators=(",", ":")).encode()


def max_message_bytes(manifest: Sequence[TensorSpec]) -> int:
    """The frame size a receiver of ``manifest`` accepts: room for a manifest twice as long as
    the expected one (a mismatched sender is still answered with the names that differ), a bucket
    header listing every tensor, and 1 MiB to spare. Larger frames are dropped unread."""
    return 2 * len(encode_manifest(manifest)) + 64 * len(manifest) + (1 << 20)


def _buffer_json(buf: ShmBuffer | CudaBuffer) -> tuple[dict[str, Any], list[bytes]]:
    if isinstance(buf, ShmBuffer):
        return {"kind": "shm", "name": buf.name, "size": buf.size, "keep": buf.keep}, []
    return (
        {
            "kind": "cuda",
            "device_uuid": buf.device_uuid,
            "size": buf.size,
            "storage_offset_bytes": buf.storage_offset_bytes,
            "ref_counter_offset": buf.ref_counter_offset,
            "event_sync_required": buf.event_sync_required,
            "keep": buf.keep,
        },
        [buf.handle, buf.ref_counter_handle, buf.event_handle, buf.filled_event],
    )


def encode(message: Request | Reply, *, manifest_frame: bytes | None = None) -> list[bytes]:
    """Frames of a message: the JSON header, then raw frames (BEGIN's manifest, CUDA handles, a
    reply's consumed-event handle).

    ``manifest_frame``: ``encode_manifest(message.manifest)`` when the caller has it already.
    """
    header: dict[str, Any] = {
        "protocol": PROTOCOL,
        "version": PROTOCOL_VERSION,
        "refit": message.refit,
    }
    raw: list[bytes] = []
    if isinstance(message, Begin):
        header.update(
            kind="begin",
            rank=message.rank,
            transport=message.transport,
            alignment=message.alignment,
            num_tensors=len(message.manifest),
        )
        if message.one_pass is not None:
            header["one_pass"] = message.one_pass
            if message.or_staged:
                header["or_staged"] = True
        raw = [manifest_frame if manifest_frame is not None else encode_manifest(message.manifest)]
    elif isinstance(message, Bucket):
        buffer, raw = _buffer_json(message.buffer)
        header.update(
            kind="bucket",
            seq=message.seq,
            buffer=buffer,
            used_bytes=message.used_bytes,
            tensors=list(message.indices),
            offsets=list(message.offsets),
        )
    elif isinstance(message, Complete):
        header.update(kind="complete", num_buckets=message.num_buckets)
        if message.one_pass:
            header["one_pass"] = True
            raw = [message.written_event] if message.written_event else []
    elif isinstance(message, Abort):
        header.update(kind="abort", reason=message.reason)
    else:
        header.update(
            kind="reply",
            ok=message.ok,
            reply_to=message.reply_to,
            seq=message.seq,
            reason=message.reason,
            report=message.report,
        )
        raw = [message.consumed_event] if message.consumed_event else []
        if message.registration is not None:
            header["registration"] = message.registration
            raw = list(message.registration_frames)
    return [json.dumps(header, separators=(",", ":")).encode(), *raw]


def _fail(reason: str) -> ProtocolError:
    return ProtocolError(reason)


def _int(header: Mapping[str, Any], key: str, *, low: int = 0, high: int = 1 << 62) -> int:
    value = header.get(key)
    if type(value) is not int or not low <= value <= high:
        raise _fail(f"header field {key!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _str(header: Mapping[str, Any], key: str, *, max_chars: int = MAX_NAME_CHARS) -> str:
    value = header.get(key)
    if not isinstance(value, str) or len(value) > max_chars:
        raise _fail(
            f"header field {key!r} must be a string of at most {max_chars} characters, got "
            f"{value!r:.80}"
        )
    return value


def _spec(item: Any, where: str) -> TensorSpec:
    if not isinstance(item, list) or len(item) < 3:
        raise _fail(f"{where} must be a list [name, dtype, shape, ...], got {item!r:.80}")
    name, dtype, shape = item[0], item[1], item[2]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise _fail(f"{where}: tensor name must be a non-empty string, got {name!r:.80}")
    if not isinstance(dtype, str) or dtype not in DTYPES_BY_NAME:
        raise _fail(
            f"{where} ({name!r}): unknown dtype {dtype!r:.40}; expected one of "
            f"{sorted(DTYPES_BY_NAME)}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise _fail(
            f"{where} ({name!r}): shape must be a list of at most {MAX_NDIM} non-negative ints, "
            f"got {shape!r:.80}"
        )
    return TensorSpec(name, tuple(shape), DTYPES_BY_NAME[dtype])


def _header(frames: Sequence[bytes]) -> dict[str, Any]:
    if not frames:
        raise _fail("empty message: expected a JSON header frame")
    first = bytes(frames[0])
    if len(first) > MAX_HEADER_BYTES:
        raise _fail(f"header frame of {len(first)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return decode_versioned_json(
        first, protocol=PROTOCOL, version=PROTOCOL_VERSION, what="header frame"
    )


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(f"{what} is not UTF-8 JSON: {exc}") from None
    except RecursionError:  # json nests by recursion: a deep enough frame exhausts the stack
        raise _fail(f"{what} nests JSON deeper than this reader's recursion limit") from None


def decode_versioned_json(raw: bytes, *, protocol: str, version: int, what: str) -> dict[str, Any]:
    """A JSON object whose `protocol` and `version` fields are ours.

    Otherwise `ProtocolError` saying why.
    """
    body = _json(raw, what)
    if not isinstance(body, dict):
        raise _fail(f"{what} must be a JSON object, got {type(body).__name__}")
    if body.get("protocol") != protocol or body.get("version") != version:
        raise _fail(
            f"{what} speaks {body.get('protocol')!r:.40} version {body.get('version')!r:.20}; "
            "this peer "
            f"speaks {protocol!r} version {version}: install the same policyworker on both sides"
        )
    return body


def decode_buffer(header: Mapping[str, Any], raw: Sequence[bytes]) -> ShmBuffer | CudaBuffer:
    """The buffer object ``header["buffer"]`` and its raw frames (``ProtocolError`` if bad)."""
    return _buffer(header, raw)


def encode_buffer(buffer: ShmBuffer | CudaBuffer) -> tuple[dict[str, Any], list[bytes]]:
    """A buffer's JSON object and raw frames (the inverse of ``decode_buffer``)."""
    return _buffer_json(buffer)


def _buffer(header: Mapping[str, Any], raw: Sequence[bytes]) -> ShmBuffer | CudaBuffer:
    buffer = header.get("buffer")
    if not isinstance(buffer, dict):
        raise _fail(f"bucket field 'buffer' must be an object, got {buffer!r:.80}")
    kind = buffer.get("kind")
    size = _int(buffer, "size")
    keep = buffer.get("keep")
    if not isinstance(keep, bool):
        raise _fail(f"buffer field 'keep' must be a bool, got {keep!r:.40}")
    if kind == "shm":
        if raw:
            raise _fail(f"a shm bucket carries no raw frames, got {len(raw)}")
        name = _str(buffer, "name", max_chars=80)
        if not SHM_NAME_RE.match(name):
            raise _fail(f"shm buffer name {name!r} does not match {SHM_NAME_RE.pattern}")
        return ShmBuffer(name, size, keep)
    if kind == "cuda":
        if len(raw) != 4 or not all(len(r) <= MAX_HANDLE_BYTES for r in raw) or not raw[3]:
            raise _fail(
                "a cuda bucket carries 4 raw frames (memory handle, ref counter, storage event, "
                f"non-empty filled event) of <= {MAX_HANDLE_BYTES} bytes, got {len(raw)}"
            )
        sync = buffer.get("event_sync_required")
        if not isinstance(sync, bool):
            raise _fail(f"buffer field 'event_sync_required' must be a bool, got {sync!r:.40}")
        return CudaBuffer(
            _str(buffer, "device_uuid", max_chars=80),
            size,
            _int(buffer, "storage_offset_bytes"),
            _int(buffer, "ref_counter_offset"),
            sync,
            *raw,
            keep=keep,
        )
    raise _fail(f"buffer kind {kind!r:.40} is unknown; expected 'shm' or 'cuda'")


class ManifestCache:
    """The receiver's last decoded manifest: a byte-identical manifest frame is not parsed again.

    ``specs`` is the same tuple object for the same bytes (a sink may cache its checks by
    identity); ``sizes[i]`` is ``specs[i].nbytes``.
    """

    def __init__(self) -> None:
        self.raw: bytes | None = None
        self.specs: tuple[TensorSpec, ...] = ()
        self.sizes: tuple[int, ...] = ()

    def decode(self, raw: bytes) -> tuple[TensorSpec, ...]:
        if raw == self.raw:
            return self.specs
        specs = _decode_manifest(raw)
        self.raw, self.specs, self.sizes = raw, specs, tuple(s.nbytes for s in specs)
        return specs


def _decode_manifest(raw: bytes) -> tuple[TensorSpec, ...]:
    if len(raw) > MAX_HEADER_BYTES:
        raise _fail(f"manifest frame of {len(raw)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    manifest = _json(raw, "manifest frame")
    if not isinstance(manifest, list):
        raise _fail(f"the manifest frame must be a JSON list, got {type(manifest).__name__}")
    return tuple(_spec(item, f"manifest[{i}]") for i, item in enumerate(manifest))


def _int_list(header: Mapping[str, Any], key: str) -> tuple[int, ...]:
    values = header.get(key)
    if (
        not isinstance(values, list)
        or len(values) > MAX_TENSORS
        or not all(type(v) is int and 0 <= v <= 1 << 62 for v in values)
    ):
        raise _fail(
            f"bucket field {key!r} must be a list of at most {MAX_TENSORS} non-negative ints, "
            f"got {values!r:.80}"
        )
    return tuple(values)


def decode_request(frames: Sequence[bytes], *, manifests: ManifestCache | None = None) -> Request:
    """Parse and type-check a sender message. Raises ``ProtocolError`` with the reason.

    ``manifests``: where a receiver keeps its last manifest parse (see ``ManifestCache``).
    """
    header = _header(frames)
    raw = [bytes(f) for f in frames[1:]]
    kind = header.get("kind")
    refit = _refit_id(header)
    if kind == "begin":
        if len(raw) != 1:
            raise _fail(
                f"a begin message carries exactly 1 raw frame (the manifest), got {len(raw)}"
            )
        specs = manifests.decode(raw[0]) if manifests is not None else _decode_manifest(raw[0])
        count = _int(header, "num_tensors")
        if count != len(specs):
            raise _fail(
                f"begin field 'num_tensors' is {count} but the manifest frame lists {len(specs)} "
                "tensors"
            )
        one_pass = header.get("one_pass")
        if one_pass is not None:
            one_pass = _str(header, "one_pass", max_chars=80)
        or_staged = header.get("or_staged", False)
        if not isinstance(or_staged, bool) or (or_staged and one_pass is None):
            raise _fail(
                f"begin field 'or_staged' is {or_staged!r:.40}; it is true or absent, and true "
                "only in a one-pass begin"
            )
        return Begin(
            _int(header, "rank"),
            _str(header, "transport", max_chars=16),
            _int(header, "alignment", low=1, high=1 << 20),
            specs,
            one_pass,
            refit,
            or_staged,
        )
    if kind == "complete" and header.get("one_pass") is True:
        if len(raw) > 1 or any(len(r) > MAX_HANDLE_BYTES for r in raw):
            raise _fail("a one-pass complete carries at most 1 raw frame (its written event)")
        return Complete(_int(header, "num_buckets"), True, raw[0] if raw else b"", refit)
    if kind != "bucket" and raw:
        raise _fail(f"a {kind!r:.20} message carries no raw frames, got {len(raw)}")
    if kind == "bucket":
        indices, offsets = _int_list(header, "tensors"), _int_list(header, "offsets")
        if len(indices) != len(offsets):
            raise _fail(
                f"bucket fields 'tensors' ({len(indices)}) and 'offsets' ({len(offsets)}) differ "
                "in length"
            )
        return Bucket(
            _int(header, "seq"),
            _buffer(header, raw),
            indices,
            offsets,
            _int(header, "used_bytes"),
            refit,
        )
    if kind == "complete":
        return Complete(_int(header, "num_buckets"), refit=refit)
    if kind == "abort":
        return Abort(_str(header, "reason", max_chars=1 << 16), refit)
    raise _fail(f"message kind {kind!r:.40} is unknown; expected begin, bucket, complete or abort")


def decode_reply(frames: Sequence[bytes]) -> Reply:
    """Parse a receiver reply. Raises ``ProtocolError`` with the reason."""
    header = _header(frames)
    if header.get("kind") != "reply" or not isinstance(header.get("ok"), bool):
        raise _fail(f"expected a reply with a boolean 'ok', got kind {header.get('kind')!r:.40}")
    report = header.get("report", {})
    if not isinstance(report, dict):
        raise _fail("reply field 'report' must be an object")
    raw = [bytes(r) for r in frames[1:]]
    registration = header.get("registration")  # a one-pass BEGIN's ACK: handles in raw frames
    most = 1 if registration is None else 8
    if len(raw) > most or any(len(r) > MAX_HANDLE_BYTES for r in raw):
        raise _fail(
            f"this reply carries at most {most} raw frame(s) of <= {MAX_HANDLE_BYTES} bytes, "
            f"got {len(raw)}"
        )
    if registration is not None and not isinstance(registration, dict):
        raise _fail("reply field 'registration' must be an object")
    return Reply(
        header["ok"],
        _str(header, "reply_to", max_chars=16),
        _int(header, "seq", low=-1),
        _str(header, "reason", max_chars=1 << 20),
        report,
        raw[0] if raw and registration is None else b"",
        registration,
        tuple(raw) if registration is not None else (),
        _refit_id(header),
    )


def _refit_id(header: Mapping[str, Any]) -> str:
    """The ``refit`` field: the id of the refit a message belongs to ("" when absent)."""
    if "refit" not in header:
        return ""
    return _str(header, "refit", max_chars=MAX_REFIT_ID_CHARS)

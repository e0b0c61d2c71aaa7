"""The one-pass fields of the refit wire: registration, BEGIN and COMPLETE round trips."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.arena import Destination
from policyworker.functional.buckets import TensorSpec
from policyworker.functional.wire.codec import (
    Begin,
    Complete,
    CudaBuffer,
    ProtocolError,
    Reply,
    ShmBuffer,
    decode_reply,
    decode_request,
    encode,
)
from policyworker.functional.wire.one_pass import (
    Registration,
    decode_registration,
    encode_registration,
)

shm = st.builds(ShmBuffer, st.just("pw-refit-0123abcd"), st.integers(0, 1 << 40), st.booleans())
cuda = st.builds(
    CudaBuffer,
    st.just("GPU-0a1b"),
    st.integers(1, 1 << 40),
    st.integers(0, 1 << 20),
    st.integers(0, 1 << 10),
    st.booleans(),
    st.binary(min_size=1, max_size=64),
    st.binary(max_size=64),
    st.binary(max_size=64),
    st.binary(min_size=1, max_size=64),
)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return tuple(strides)


destinations = st.lists(
    st.builds(
        Destination,
        st.text("abc.", min_size=1, max_size=8),
        st.sampled_from([torch.bfloat16, torch.float32, torch.int64, torch.bool]),
        st.lists(st.integers(0, 9), max_size=3).map(tuple),
        st.just(()),
        st.integers(0, 1 << 30),
    ).map(lambda d: Destination(d.name, d.dtype, d.shape, _contiguous(d.shape), d.offset_bytes)),
    max_size=6,
)


@given(
    kind=st.sampled_from(["shm", "cuda"]),
    data=st.data(),
    dests=destinations,
    atomic=st.booleans(),
)
def test_a_registration_round_trips_through_a_begin_ack(kind, data, dests, atomic):
    buffers = shm if kind == "shm" else cuda
    arena = data.draw(buffers)
    spare = data.draw(buffers) if atomic else None
    registration = Registration("ab12", arena, spare, 1 << 20, tuple(dests))
    body, raw = encode_registration(registration, held_id=None)
    reply = decode_reply(encode(Reply(True, "begin", registration=body, registration_frames=raw)))
    assert decode_registration(reply.registration, reply.registration_frames) == registration
    assert registration.write_target == (arena if spare is None else spare)
    # a sender holding this id gets the id alone
    body, raw = encode_registration(registration, held_id="ab12")
    assert body == {"id": "ab12"} and raw == []
    assert decode_registration(body, raw) == "ab12"


@given(
    held=st.one_of(st.none(), st.text("0123456789abcdef", max_size=16)),
    event=st.binary(),
    or_staged=st.booleans(),
)
def test_one_pass_begin_and_complete_round_trip_and_staged_frames_are_unchanged(
    held, event, or_staged
):
    manifest = (TensorSpec("w", (2, 3), torch.bfloat16),)
    begin = Begin(0, "cuda", 512, manifest, held, or_staged=or_staged and held is not None)
    assert decode_request(encode(begin)) == begin
    complete = Complete(0, True, event)
    assert decode_request(encode(complete)) == complete
    staged = Begin(0, "shm", 512, manifest)
    assert b"one_pass" not in encode(staged)[0] and b"one_pass" not in encode(Complete(3))[0]


def test_or_staged_is_read_only_as_true_in_a_one_pass_begin():
    manifest = (TensorSpec("w", (2, 3), torch.bfloat16),)
    frames = encode(Begin(0, "shm", 512, manifest, "", or_staged=True))
    assert b"or_staged" in frames[0]
    header = json.loads(frames[0])
    for bad in ({**header, "or_staged": 1}, {k: v for k, v in header.items() if k != "one_pass"}):
        with pytest.raises(ProtocolError, match="or_staged"):
            decode_request([json.dumps(bad).encode(), *frames[1:]])
    # a staged begin never carries it, whatever the field says
    assert b"or_staged" not in encode(Begin(0, "shm", 512, manifest, None, or_staged=True))[0]


def test_malformed_registrations_are_refused_naming_the_field():
    arena = ShmBuffer("pw-refit-0123abcd", 64)
    good, raw = encode_registration(
        Registration("id1", arena, None, 64, (Destination("w", torch.float32, (4,), (1,), 0),)),
        held_id=None,
    )
    with pytest.raises(ProtocolError, match="'id' must be a non-empty string"):
        decode_registration({**good, "id": 7}, raw)
    with pytest.raises(ProtocolError, match="unknown dtype"):
        decode_registration({**good, "destinations": [["w", "float99", [4], [1], 0]]}, raw)
    with pytest.raises(ProtocolError, match="one stride per dimension"):
        decode_registration({**good, "destinations": [["w", "float32", [4], [], 0]]}, raw)
    with pytest.raises(ProtocolError, match="handle frames are missing"):
        decode_registration({**good, "arena": {"kind": "cuda", "size": 64, "keep": False}}, [])
    with pytest.raises(ProtocolError, match="left over"):
        decode_registration(good, [b"stray"])
    with pytest.raises(ProtocolError, match="at most 1 raw frame"):
        decode_request([*encode(Complete(0, True, b"e")), b"more"])

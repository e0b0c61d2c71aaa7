"""The nixl engine's notification frames: encode then decode is the identity, and bytes that are
not a frame of ours decode to None without raising."""

from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.wire.nixl_frames import MAGIC, decode_frame, encode_frame

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
headers = st.dictionaries(st.text(max_size=12), json_values, max_size=6)


@given(header=headers, payload=st.binary(max_size=256))
def test_encode_then_decode_is_identity(header, payload):
    frame = decode_frame(encode_frame(header, payload))
    assert frame is not None and frame.header == header and frame.payload == payload


@given(raw=st.binary(max_size=64))
def test_bytes_without_the_magic_are_not_a_frame(raw):
    if not raw.startswith(MAGIC):
        assert decode_frame(raw) is None


@given(header=headers, payload=st.binary(max_size=32), cut=st.integers(0, 400))
def test_a_truncated_or_mangled_frame_decodes_to_none_or_a_frame_never_raises(header, payload, cut):
    raw = encode_frame(header, payload)
    frame = decode_frame(raw[:cut])
    assert frame is None or isinstance(frame.header, dict)
    assert decode_frame(MAGIC + b"\x00\x00\x00\x05[1,2]") is None  # a header must be an object

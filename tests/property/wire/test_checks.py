"""The receiver-side checks of the refit wire that have no home in the codec's tests:
``self_overlap_problem`` (a destination whose elements could share memory) and the refit id
every message and reply carries."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.wire.checks import self_overlap_problem
from policyworker.functional.wire.codec import (
    Abort,
    Begin,
    Bucket,
    Complete,
    Reply,
    ShmBuffer,
    decode_reply,
    decode_request,
    encode,
)

small_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def _offsets(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int]:
    return [
        sum(i * s for i, s in zip(index, strides, strict=True))
        for index in itertools.product(*(range(n) for n in shape))
    ]


@given(shape=small_shapes, data=st.data())
def test_an_accepted_layout_maps_every_element_to_its_own_location(shape, data):
    strides = tuple(
        data.draw(st.lists(st.integers(0, 20), min_size=len(shape), max_size=len(shape)))
    )
    if self_overlap_problem("w", shape, strides) is None:
        offsets = _offsets(shape, strides)
        assert len(set(offsets)) == len(offsets)


@given(shape=small_shapes, perm_seed=st.randoms())
def test_contiguous_and_permuted_layouts_are_accepted(shape, perm_seed):
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    order = list(range(len(shape)))
    perm_seed.shuffle(order)
    assert self_overlap_problem("w", shape, tuple(strides)) is None
    permuted = tuple(shape[i] for i in order), tuple(strides[i] for i in order)
    assert self_overlap_problem("w", *permuted) is None


@given(shape=small_shapes.filter(lambda s: any(n > 1 for n in s) and 0 not in s), data=st.data())
def test_a_zero_stride_on_a_dimension_of_two_or_more_is_refused_by_name(shape, data):
    dim = data.draw(st.sampled_from([i for i, n in enumerate(shape) if n > 1]))
    strides = [data.draw(st.integers(1, 50)) for _ in shape]
    strides[dim] = 0
    problem = self_overlap_problem("layers.0.w", shape, tuple(strides))
    assert problem is not None and "'layers.0.w'" in problem


refit_ids = st.text(alphabet="0123456789abcdef", min_size=0, max_size=64)


@given(refit=refit_ids, seq=st.integers(0, 99), ok=st.booleans())
def test_every_message_and_reply_round_trips_its_refit_id(refit, seq, ok):
    messages = [
        Begin(0, "shm", 512, (), None, refit),
        Bucket(seq, ShmBuffer("pw-refit-0123abcd", 512), (), (), 0, refit),
        Complete(seq, refit=refit),
        Abort("why", refit),
    ]
    for message in messages:
        assert decode_request(encode(message)) == message
    reply = Reply(ok, "bucket", seq, "", refit=refit)
    decoded = decode_reply(encode(reply))
    assert decoded == reply and decoded.answers("bucket", refit, seq)
    assert not decoded.answers("complete", refit, seq)
    assert not decoded.answers("bucket", refit + "0", seq)
    assert not decoded.answers("bucket", refit, seq + 1)

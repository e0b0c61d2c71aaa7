"""The refit wire format: round trips, manifest checks, and fuzzing of the receiver's handler."""

import contextlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from policyworker.functional.buckets import TensorSpec, pack_tensors, plan_ipc_buckets
from policyworker.functional.wire.codec import (
    DTYPES_BY_NAME,
    PROTOCOL,
    PROTOCOL_VERSION,
    Abort,
    Begin,
    Bucket,
    Complete,
    CudaBuffer,
    ManifestCache,
    ProtocolError,
    Reply,
    ShmBuffer,
    check_manifest,
    decode_reply,
    decode_request,
    encode,
    encode_manifest,
)
from policyworker.shell.refit.receiver import WeightApplier
from policyworker.shell.refit.zmq.server import RefitServer
from policyworker.shell.refit.zmq.staging import ShmStaging

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20)
dtypes = st.sampled_from(sorted(DTYPES_BY_NAME.values(), key=str))
shapes = st.lists(st.integers(0, 6), max_size=4).map(tuple)
specs = st.builds(TensorSpec, names, shapes, dtypes)


@given(manifest=st.lists(specs, max_size=5), rank=st.integers(0, 64))
def test_begin_round_trips(manifest, rank):
    message = Begin(rank, "shm", 512, tuple(manifest))
    assert decode_request(encode(message)) == message


@given(
    tensors=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**9)), max_size=5),
    seq=st.integers(0, 99),
    size=st.integers(0, 10**9),
    keep=st.booleans(),
)
def test_bucket_complete_abort_and_reply_round_trip(tensors, seq, size, keep):
    bucket = Bucket(
        seq,
        ShmBuffer("pw-refit-0123abcd", size, keep),
        tuple(i for i, _ in tensors),
        tuple(off for _, off in tensors),
        size,
    )
    assert decode_request(encode(bucket)) == bucket
    assert decode_request(encode(Complete(seq))) == Complete(seq)
    assert decode_request(encode(Abort("why"))) == Abort("why")
    reply = Reply(False, "bucket", seq, "bad", {"version": 3})
    assert decode_reply(encode(reply)) == reply


handles = st.binary(min_size=1, max_size=64)


@given(
    handle=handles,
    rc=handles,
    event=st.binary(max_size=64),
    filled=handles,
    keep=st.booleans(),
    consumed=st.binary(max_size=64),
    ok=st.booleans(),
)
def test_cuda_bucket_and_event_reply_round_trip(handle, rc, event, filled, keep, consumed, ok):
    buffer = CudaBuffer("GPU-0a1b", 4096, 0, 16, True, handle, rc, event, filled, keep)
    bucket = Bucket(3, buffer, (0, 1), (0, 512), 1024)
    assert decode_request(encode(bucket)) == bucket
    reply = Reply(ok, "bucket", 3, "", {}, consumed)
    assert decode_reply(encode(reply)) == reply


def test_cuda_bucket_without_a_filled_event_is_rejected():
    buffer = CudaBuffer("GPU-0a1b", 4096, 0, 16, True, b"h", b"r", b"e", b"f")
    frames = encode(Bucket(0, buffer, (0,), (0,), 512))
    with pytest.raises(ProtocolError, match="4 raw frames"):
        decode_request([*frames[:-1], b""])
    with pytest.raises(ProtocolError, match="4 raw frames"):
        decode_request(frames[:-1])
    with pytest.raises(ProtocolError, match="at most 1 raw frame"):
        decode_reply([*encode(Reply(True, "bucket", 0)), b"a", b"b"])


@given(manifest=st.lists(specs, max_size=5))
def test_manifest_cache_returns_the_same_object_for_the_same_bytes(manifest):
    cache = ManifestCache()
    frames = encode(Begin(0, "shm", 512, tuple(manifest)))
    first = decode_request(frames, manifests=cache).manifest
    again = decode_request(
        list(encode(Begin(1, "shm", 512, tuple(manifest)))), manifests=cache
    ).manifest
    assert first == tuple(manifest) and again is first
    assert cache.sizes == tuple(s.nbytes for s in manifest)
    other = (*manifest, TensorSpec("extra", (2,), torch.int8))
    assert decode_request(encode(Begin(0, "shm", 512, other)), manifests=cache).manifest == other


def test_begin_frames_must_agree_on_the_tensor_count():
    frames = encode(Begin(0, "shm", 512, tuple(_spec_list(3))))
    header = json.loads(frames[0])
    header["num_tensors"] = 2
    with pytest.raises(ProtocolError, match="'num_tensors' is 2 but the manifest frame lists 3"):
        decode_request([json.dumps(header).encode(), frames[1]])
    with pytest.raises(ProtocolError, match="exactly 1 raw frame"):
        decode_request(frames[:1])
    assert frames[1] == encode_manifest(_spec_list(3))


@given(frames=st.lists(st.binary(max_size=200), max_size=4))
def test_arbitrary_bytes_decode_to_a_protocol_error_or_a_message(frames):
    with contextlib.suppress(ProtocolError):
        decode_request(frames)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _spec_list(n):
    return [TensorSpec(f"w{i}", (3, 4), torch.float32) for i in range(n)]


def test_check_manifest_names_missing_unexpected_duplicate_and_mismatched():
    expected = {s.name: (torch.Size(s.shape), s.dtype) for s in _spec_list(4)}
    sent = [
        *_spec_list(2),
        TensorSpec("w1", (3, 4), torch.float32),
        TensorSpec("w3", (4, 3), torch.float32),
        TensorSpec("extra", (1,), torch.int64),
    ]
    problems = " | ".join(check_manifest(sent, expected))
    assert "duplicate names: 'w1'" in problems
    assert "unexpected names (not in refit_info): 'extra'" in problems
    assert "missing names (in refit_info, not sent): 'w2'" in problems
    assert "'w3' sent float32[4, 3] vs refit_info float32[3, 4]" in problems
    assert check_manifest(_spec_list(4), expected) == []


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.register_buffer("steps", torch.arange(5))


@pytest.fixture(scope="module")
def fuzz_setup():
    model = _Tiny()
    info = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    specs_ = [TensorSpec(k, tuple(s), d) for k, (s, d) in info.items()]
    plan = plan_ipc_buckets(specs_, 4096)
    staging = ShmStaging(4096)
    pack_tensors(
        [torch.ones(s.shape, dtype=s.dtype) for s in specs_], plan[0].offsets, staging.tensor
    )
    bucket = Bucket(0, staging.ref(), plan[0].indices, plan[0].offsets, plan[0].used_bytes)
    yield model, info, specs_, bucket
    staging.close()


def _mutations():
    """Ways to break a valid bucket header: (path of keys/indices, invalid value)."""
    return st.sampled_from(
        [
            (("protocol",), "other"),
            (("version",), 1),
            (("version",), "2"),
            (("kind",), "bucket!"),
            (("seq",), -1),
            (("seq",), 1.5),
            (("used_bytes",), 10**9),
            (("used_bytes",), 1),
            (("buffer", "kind"), "tcp"),
            (("buffer", "name"), "../etc/passwd"),
            (("buffer", "name"), "pw-refit-ffffffffffff"),
            (("buffer", "size"), 10**12),
            (("buffer", "size"), 16),
            (("buffer", "keep"), "yes"),
            (("tensors", 0), 3),
            (("tensors", 0), -1),
            (("tensors", 0), "a.weight"),
            (("tensors", 1), 0),
            (("tensors", 1), None),
            (("tensors",), {}),
            (("tensors",), [0, 1]),
            (("offsets", 0), 3),
            (("offsets", 1), 0),
            (("offsets", 2), 10**6),
            (("offsets",), [0]),
            (("offsets", 0), 1.0),
        ]
    )


def _set(header, path, value):
    node = header
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@given(
    mutation=_mutations(),
    extra_frames=st.lists(st.binary(max_size=8), max_size=2),
    junk=st.one_of(st.none(), st.binary(max_size=64), json_values),
)
@settings(max_examples=60)
def test_fuzzed_bucket_is_answered_with_a_rejection_and_never_writes(
    fuzz_setup, mutation, extra_frames, junk
):
    model, info, specs_, bucket = fuzz_setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    server = RefitServer(WeightApplier(model, info, atomic=False))
    reply, outcome = server.handle(encode(Begin(0, "shm", 512, tuple(specs_))))
    assert decode_reply(reply).ok and outcome.error is None
    if junk is None:
        header = json.loads(encode(bucket)[0])
        _set(header, mutation[0], mutation[1])
        frames = [json.dumps(header).encode(), *extra_frames]
    elif isinstance(junk, bytes):
        frames = [junk, *extra_frames]
    else:
        frames = [
            json.dumps(
                {
                    "protocol": PROTOCOL,
                    "version": PROTOCOL_VERSION,
                    "kind": "bucket",
                    **(junk if isinstance(junk, dict) else {"tensors": junk}),
                }
            ).encode()
        ]
    reply, outcome = server.handle(frames)
    decoded = decode_reply(reply)
    assert not decoded.ok and decoded.reason and outcome.error is not None
    assert not server.in_refit
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_valid_stream_through_the_handler_writes_and_reports(fuzz_setup):
    model, info, specs_, bucket = fuzz_setup
    server = RefitServer(WeightApplier(model, info, atomic=False))
    for message in (Begin(0, "shm", 512, tuple(specs_)), bucket):
        reply, outcome = server.handle(encode(message))
        assert decode_reply(reply).ok, decode_reply(reply).reason
    reply, outcome = server.handle(encode(Complete(1)))
    assert (
        outcome.done
        and outcome.report.version == 1
        and decode_reply(reply).report["num_tensors"] == 3
    )
    assert torch.equal(model.a.weight, torch.ones(3, 4)) and torch.equal(
        model.steps, torch.ones(5, dtype=torch.int64)
    )


def test_messages_out_of_order_are_rejected(fuzz_setup):
    model, info, specs_, bucket = fuzz_setup
    server = RefitServer(WeightApplier(model, info, atomic=False))
    for message, reason in [
        (bucket, "BUCKET before BEGIN"),
        (Complete(0), "COMPLETE before BEGIN"),
    ]:
        reply, outcome = server.handle(encode(message))
        assert reason in decode_reply(reply).reason and outcome.error is not None
    server.handle(encode(Begin(0, "shm", 512, tuple(specs_))))
    reply, _ = server.handle(encode(Complete(0)))
    assert "tensors never sent" in decode_reply(reply).reason


def test_an_abort_outside_a_refit_is_answered_and_changes_nothing(fuzz_setup):
    """A late ABORT of a refit this side already ended must not end the next one."""
    model, info, specs_, bucket = fuzz_setup
    server = RefitServer(WeightApplier(model, info, atomic=False))
    reply, outcome = server.handle(encode(Abort("trainer died")))
    assert decode_reply(reply).ok and not outcome.done and outcome.error is None
    assert not server.in_refit
    assert _stream_once(server, specs_, bucket).version == 1


def _manifest_mutations():
    """Ways to break a valid manifest frame (entries are [name, dtype, shape])."""
    return st.sampled_from(
        [
            (("dtype", 0), "float16"),
            (("dtype", 1), "object"),
            (("shape", 0), [4, 3]),
            (("shape", 2), [-1]),
            (("name", 0), "not_a_param"),
            (("name", 1), "steps"),
            (("drop", 2), None),
            (("append", 0), ["extra", "int64", [1]]),
            (("raw", 0), b"\xff\x00not json"),
            (("raw", 0), b"{}"),
        ]
    )


@given(mutation=_manifest_mutations())
@settings(max_examples=30)
def test_fuzzed_manifest_is_rejected_at_begin_and_never_writes(fuzz_setup, mutation):
    model, info, specs_, bucket = fuzz_setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    server = RefitServer(WeightApplier(model, info, atomic=False))
    (what, index), value = mutation
    manifest = json.loads(encode_manifest(specs_))
    if what == "raw":
        raw = value
    else:
        if what == "drop":
            del manifest[index]
        elif what == "append":
            manifest.append(value)
        else:
            manifest[index][("name", "dtype", "shape").index(what)] = value
        raw = json.dumps(manifest).encode()
    header = json.loads(encode(Begin(0, "shm", 512, tuple(specs_)))[0])
    header["num_tensors"] = len(manifest) if what != "raw" else len(specs_)
    reply, outcome = server.handle([json.dumps(header).encode(), raw])
    decoded = decode_reply(reply)
    assert not decoded.ok and decoded.reason and outcome.error is not None
    assert not server.in_refit
    reply, outcome = server.handle(encode(bucket))  # a bucket after the rejection is refused too
    assert not decode_reply(reply).ok and "BUCKET before BEGIN" in decode_reply(reply).reason
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _stream_once(server, specs_, bucket):
    for message in (Begin(0, "shm", 512, tuple(specs_)), bucket, Complete(1)):
        reply, outcome = server.handle(encode(message))
        assert decode_reply(reply).ok, decode_reply(reply).reason
    return outcome.report


def test_kept_buffers_stay_mapped_with_their_views_and_others_are_closed():
    model = _Tiny()
    info = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    specs_ = [TensorSpec(k, tuple(s), d) for k, (s, d) in info.items()]
    plan = plan_ipc_buckets(specs_, 4096)[0]
    server = RefitServer(WeightApplier(model, info, atomic=False))
    staging = ShmStaging(4096)
    try:
        for value in (1, 2):  # the sender keeps the buffer: one mapping, reused, same views
            pack_tensors(
                [torch.full(s.shape, value, dtype=s.dtype) for s in specs_],
                plan.offsets,
                staging.tensor,
            )
            report = _stream_once(
                server,
                specs_,
                Bucket(0, staging.ref(keep=True), plan.indices, plan.offsets, plan.used_bytes),
            )
            assert report.version == value and server.open_buffers == 1
            assert torch.equal(model.a.weight, torch.full((3, 4), float(value)))
            assert torch.equal(model.steps, torch.full((5,), value))
        # the same buffer and offsets under a manifest in another order: views are rebuilt for it
        reordered = specs_[::-1]
        offsets = plan_ipc_buckets(reordered, 4096)[0].offsets
        pack_tensors(
            [torch.full(s.shape, 7, dtype=s.dtype) for s in reordered], offsets, staging.tensor
        )
        _stream_once(
            server,
            reordered,
            Bucket(0, staging.ref(keep=True), (0, 1, 2), offsets, plan.used_bytes),
        )
        assert torch.equal(model.a.weight, torch.full((3, 4), 7.0)) and torch.equal(
            model.steps, torch.full((5,), 7)
        )
        # not kept: closed at COMPLETE; a kept one is closed by a failed refit and by
        # release_buffers
        _stream_once(
            server,
            reordered,
            Bucket(0, staging.ref(keep=False), (0, 1, 2), offsets, plan.used_bytes),
        )
        assert server.open_buffers == 0
        _stream_once(
            server,
            reordered,
            Bucket(0, staging.ref(keep=True), (0, 1, 2), offsets, plan.used_bytes),
        )
        assert server.open_buffers == 1
        server.release_buffers()
        assert server.open_buffers == 0
        server.handle(encode(Begin(0, "shm", 512, tuple(reordered))))
        server.handle(
            encode(Bucket(0, staging.ref(keep=True), (0, 1, 2), offsets, plan.used_bytes))
        )
        assert server.open_buffers == 1
        reply, outcome = server.handle(encode(Abort("sender failed")))
        assert outcome.error is not None and server.open_buffers == 0
    finally:
        staging.close()

"""The refit wire format: round trips, manifest checks, and fuzzing of the receiver's handler."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from policyworker.functional.buckets import TensorSpec, pack_tensors, plan_ipc_buckets
from policyworker.shell.receiver import WeightApplier
from policyworker.shell.transports.wire import (
    DTYPES_BY_NAME,
    PROTOCOL,
    PROTOCOL_VERSION,
    Abort,
    Begin,
    Bucket,
    Complete,
    ProtocolError,
    Reply,
    ShmBuffer,
    WireTensor,
    check_manifest,
    decode_reply,
    decode_request,
    encode,
)
from policyworker.shell.transports.zmq_ipc import RefitServer, ShmStaging

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20)
dtypes = st.sampled_from(sorted(DTYPES_BY_NAME.values(), key=str))
shapes = st.lists(st.integers(0, 6), max_size=4).map(tuple)
specs = st.builds(TensorSpec, names, shapes, dtypes)


@given(manifest=st.lists(specs, max_size=5), rank=st.integers(0, 64))
def test_begin_round_trips(manifest, rank):
    message = Begin(rank, "shm", 512, tuple(manifest))
    assert decode_request(encode(message)) == message


@given(
    tensors=st.lists(st.tuples(specs, st.integers(0, 10**6)), max_size=5),
    seq=st.integers(0, 99),
    size=st.integers(0, 10**9),
)
def test_bucket_complete_abort_and_reply_round_trip(tensors, seq, size):
    bucket = Bucket(
        seq,
        ShmBuffer("pw-refit-0123abcd", size),
        tuple(WireTensor(s, off, s.nbytes) for s, off in tensors),
        size,
    )
    assert decode_request(encode(bucket)) == bucket
    assert decode_request(encode(Complete(seq))) == Complete(seq)
    assert decode_request(encode(Abort("why"))) == Abort("why")
    reply = Reply(False, "bucket", seq, "bad", {"version": 3})
    assert decode_reply(encode(reply)) == reply


@given(frames=st.lists(st.binary(max_size=200), max_size=4))
def test_arbitrary_bytes_decode_to_a_protocol_error_or_a_message(frames):
    try:
        decode_request(frames)
    except ProtocolError:
        pass


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
    bucket = Bucket(
        0,
        staging.ref,
        tuple(WireTensor(s, o, s.nbytes) for s, o in zip(specs_, plan[0].offsets)),
        plan[0].used_bytes,
    )
    yield model, info, specs_, bucket
    staging.close()


def _mutations():
    """Ways to break a valid header: (path of keys/indices, invalid value)."""
    return st.sampled_from(
        [
            (("protocol",), "other"),
            (("version",), 2),
            (("version",), "1"),
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
            (("tensors", 0, 0), "not_a_param"),
            (("tensors", 0, 1), "float16"),
            (("tensors", 0, 1), "object"),
            (("tensors", 0, 2), [4, 3]),
            (("tensors", 0, 2), [-1]),
            (("tensors", 0, 3), 3),
            (("tensors", 1, 3), 0),
            (("tensors", 0, 4), 999),
            (("tensors", 1), None),
            (("tensors",), {}),
            (("tensors", 2, 0), "a.weight"),
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

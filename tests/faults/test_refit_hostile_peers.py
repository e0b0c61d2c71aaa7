"""A hostile or broken refit peer is refused with a named ``RefitError`` / ``ValueError``: a
reply nested deeper than the JSON reader's recursion, and a one-pass registration whose
destination lets two elements share memory."""

from __future__ import annotations

import json
import threading
from typing import Any

import attrs
import pytest
import torch
import zmq
from torch import nn

from policyworker.errors import RefitError
from policyworker.functional.wire.codec import ProtocolError
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender

pytestmark = pytest.mark.faults


class _Weights(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w0 = nn.Parameter(torch.randn(4, 8, generator=gen))
        self.w1 = nn.Parameter(torch.randn(8, generator=gen))


def _answer_once(address: str, reply: list[bytes], stop: threading.Event) -> threading.Thread:
    def run() -> None:
        context = zmq.Context()
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while not stop.is_set():
                if sock.poll(50, zmq.POLLIN):
                    sock.recv_multipart()
                    sock.send_multipart(reply)
        finally:
            sock.close(linger=0)
            context.term()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_reply_nested_deeper_than_the_json_reader_recurses_is_a_refit_error():
    sender = RefitSender(lambda: _Weights(1), torch.float32)
    stop = threading.Event()
    deep = b"[" * 200_000 + b"]" * 200_000
    thread = _answer_once(sender.get_zmq_address(), [deep], stop)
    try:
        with pytest.raises(RefitError, match="nests JSON deeper"):
            sender.stream_weights_via_ipc_zmq(16 << 10, timeout_s=5)
    finally:
        stop.set()
        thread.join(5)
        sender.close()


def test_a_one_pass_registration_with_a_zero_stride_is_refused_by_name_before_any_write():
    """The receiver registers ``w0`` with strides (0, 1): the sender refuses the registration
    naming ``w0`` (a ``ProtocolError``) instead of failing mid-write with torch's error."""
    trainer, engine = _Weights(1), _Weights(2)
    sender = RefitSender(lambda: trainer, torch.float32, one_pass=True)
    receiver = HFWeightReceiver(
        engine,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=10,
        one_pass=True,
    )
    arena = receiver.arena
    assert arena is not None
    registration = arena.registration()
    hostile = tuple(
        attrs.evolve(d, strides=(0, 1)) if d.name == "w0" else d for d in registration.destinations
    )
    arena._registration = attrs.evolve(registration, destinations=hostile)
    before = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    box: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: box.update(error=_catch(receiver.receive)), daemon=True
    )
    thread.start()
    try:
        with pytest.raises(ProtocolError, match="'w0'.*share memory"):
            sender.stream_weights_via_ipc_zmq(timeout_s=10)
        thread.join(15)
        for name, want in before.items():
            torch.testing.assert_close(engine.state_dict()[name], want, msg=name)
    finally:
        receiver.close()
        sender.close()


def test_a_module_whose_weight_is_expanded_is_refused_when_registering_for_one_pass():
    class Expanded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w0 = nn.Parameter(torch.zeros(8).expand(4, 8))
            self.w1 = nn.Parameter(torch.zeros(8))

    sender = RefitSender(lambda: _Weights(1), torch.float32)
    try:
        with pytest.raises(ValueError, match="'w0'"):
            HFWeightReceiver(
                Expanded(),
                address=sender.get_zmq_address(),
                refit_info=sender.prepare_refit_info(),
                timeout_s=5,
                one_pass=True,
            )
    finally:
        sender.close()


def _catch(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # the test reads it
        return exc


def test_a_nested_reply_header_is_refused_by_the_decoder_itself():
    from policyworker.functional.wire.codec import decode_reply

    header = {"protocol": "policyworker-refit", "version": 4, "kind": "reply"}
    raw = json.dumps(header)[:-1].encode() + b',"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ProtocolError):
        decode_reply([raw])

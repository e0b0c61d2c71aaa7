"""Refit replies are bound to their requests: a late reply to an old refit is discarded, never
read as the answer to a new request, and a receiver answering anything but the request it was
sent is refused with ``ProtocolError``."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
import zmq
from torch import nn

from policyworker.errors import RefitTimeoutError
from policyworker.functional.wire.codec import (
    PROTOCOL,
    PROTOCOL_VERSION,
    ProtocolError,
)
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender

pytestmark = pytest.mark.faults


class _Weights(nn.Module):
    """Eight 4 KiB fp32 tensors: with 16 KiB of staging they travel in several buckets."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i in range(8):
            setattr(self, f"w{i}", nn.Parameter(torch.randn(4, 256, generator=gen)))


def _receive_in_thread(
    receiver: HFWeightReceiver, refits: int = 1
) -> tuple[threading.Thread, dict[str, Any]]:
    """``receive()`` until ``refits`` reports (or 4 errors) in a thread, as an engine's loop."""
    box: dict[str, Any] = {"reports": [], "errors": []}

    def run() -> None:
        while len(box["reports"]) < refits and len(box["errors"]) < 4:
            try:
                box["reports"].append(receiver.receive())
            except Exception as exc:  # reported by the test
                box["errors"].append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.mark.parametrize("keep_staging", [False, True])
def test_a_late_complete_reply_after_a_sender_timeout_is_not_read_by_the_next_refit(
    keep_staging,
):
    """The receiver's COMPLETE outlasts the sender's timeout; the next refit must not read that
    late reply as its BEGIN's ACK (every later reply would be one request late, and a kept
    staging half could be refilled before the receiver read it)."""
    trainer = _Weights(seed=1)
    engine = _Weights(seed=2)
    sender = RefitSender(lambda: trainer, torch.float32, keep_staging=keep_staging)
    receiver = HFWeightReceiver(
        engine,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=20,
    )
    slow = {"on": True}
    commit = receiver.applier.commit

    def slow_commit(**kwargs: Any) -> Any:
        if slow["on"]:
            slow["on"] = False
            time.sleep(2.0)  # an engine's post-load processing, longer than the sender waits
        return commit(**kwargs)

    receiver.applier.commit = slow_commit  # type: ignore[method-assign]
    try:
        # one loop serves both refits: the next BEGIN is sent while the receiver still commits
        thread, box = _receive_in_thread(receiver, refits=2)
        with pytest.raises(RefitTimeoutError):
            sender.stream_weights_via_ipc_zmq(16 << 10, timeout_s=0.5)
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(-3.0)
        report = sender.stream_weights_via_ipc_zmq(16 << 10, timeout_s=10)
        thread.join(15)
        assert len(box["reports"]) == 2 and not box["errors"], box
        assert report.get("num_tensors") == 8, f"the sender read another request's reply: {report}"
        for name, want in trainer.state_dict().items():
            torch.testing.assert_close(engine.state_dict()[name], want, msg=name)
    finally:
        receiver.close()
        sender.close()


def _fake_receiver(address: str, answer: Any, stop: threading.Event) -> threading.Thread:
    """A REP socket answering every request with ``answer(header)``'s reply header."""

    def run() -> None:
        context = zmq.Context()
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while not stop.is_set():
                if not sock.poll(50, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
                header = json.loads(frames[0])
                sock.send_multipart([json.dumps(answer(header)).encode()])
        finally:
            sock.close(linger=0)
            context.term()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _complete_to_everything(header: dict[str, Any]) -> dict[str, Any]:
    """Echo the request's refit id and sequence, but always claim to answer COMPLETE."""
    return {
        "protocol": PROTOCOL,
        "version": PROTOCOL_VERSION,
        "kind": "reply",
        "ok": True,
        "reply_to": "complete",
        "refit": header.get("refit", ""),
        "seq": header.get("seq", -1),
        "reason": "",
        "report": {"num_tensors": 8},
    }


def _unbound_ok(header: dict[str, Any]) -> dict[str, Any]:
    """The right kind, but no refit id: a reply that names no request."""
    reply = _complete_to_everything(header)
    reply.update(reply_to=header["kind"], refit="")
    return reply


@pytest.mark.parametrize("answer", [_complete_to_everything, _unbound_ok])
def test_a_receiver_whose_replies_do_not_name_the_request_is_refused(answer):
    trainer = _Weights(seed=1)
    sender = RefitSender(lambda: trainer, torch.float32)
    stop = threading.Event()
    thread = _fake_receiver(sender.get_zmq_address(), answer, stop)
    try:
        with pytest.raises(ProtocolError, match="reply"):
            sender.stream_weights_via_ipc_zmq(16 << 10, timeout_s=5)
    finally:
        stop.set()
        thread.join(5)
        sender.close()


def test_a_retry_right_after_a_timeout_succeeds_at_once():
    """A receiver slow to answer BEGIN once: the first refit times out; the retry (its stale
    BEGIN reply still in flight) must succeed on its first attempt."""
    trainer = _Weights(seed=1)
    engine = _Weights(seed=2)
    sender = RefitSender(lambda: trainer, torch.float32)
    receiver = HFWeightReceiver(
        engine,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=20,
    )
    begin = receiver.applier.begin
    slow = {"on": True}

    def slow_begin(manifest: Any, **kwargs: Any) -> Any:
        if slow["on"]:
            slow["on"] = False
            time.sleep(1.0)
        return begin(manifest, **kwargs)

    receiver.applier.begin = slow_begin  # type: ignore[method-assign]
    try:
        thread, box = _receive_in_thread(receiver)
        with pytest.raises(RefitTimeoutError):
            sender.stream_weights_via_ipc_zmq(16 << 10, timeout_s=0.4)
        report = sender.stream_weights_via_ipc_zmq(16 << 10, timeout_s=10)
        thread.join(15)
        assert report.get("num_tensors") == 8 and len(box["reports"]) == 1, (report, box)
        for name, want in trainer.state_dict().items():
            torch.testing.assert_close(engine.state_dict()[name], want, msg=name)
    finally:
        receiver.close()
        sender.close()

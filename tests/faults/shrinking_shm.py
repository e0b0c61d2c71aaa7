"""Scenarios where a peer shrinks a shared-memory file the other side is about to copy; each runs
in a fresh process (``python -m tests.faults.shrinking_shm NAME``), since before the fix the
copy was a SIGBUS that killed the process. Prints one ``@@{json}`` result line."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
from torch import nn


class _Weights(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i in range(4):
            setattr(self, f"w{i}", nn.Parameter(torch.randn(64, 64, generator=gen)))


def _say(ok: bool, detail: str) -> None:
    print("@@" + json.dumps({"ok": ok, "detail": detail[:800]}), flush=True)


def _receive(receiver: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["report"] = receiver.receive()
        except Exception as exc:  # reported by the scenario
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def staged_sender_shrinks_its_buffer_mid_copy() -> None:
    """The staging file is truncated to 0 after the receiver checked and opened it, just before
    it copies the bucket (what a hostile or buggy sender does mid-copy)."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender
    from policyworker.shell.refit.zmq import ipc_files

    trainer, engine = _Weights(1), _Weights(2)
    sender = RefitSender(lambda: trainer, torch.float32)
    receiver = HFWeightReceiver(
        engine,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=10,
        one_pass=False,  # a staged refit: the sender's staging file is what shrinks
    )
    apply = receiver.applier.apply_prepared
    truncated: list[str] = []

    def shrink_then_apply(batch: Any) -> None:
        for name in os.listdir(ipc_files.SHM_DIR):
            if name.startswith("pw-refit-"):
                os.truncate(os.path.join(ipc_files.SHM_DIR, name), 0)
                truncated.append(name)
        apply(batch)

    receiver.applier.apply_prepared = shrink_then_apply  # type: ignore[method-assign]
    thread, box = _receive(receiver)
    try:
        sender.stream_weights_via_ipc_zmq(1 << 20, timeout_s=10)
        outcome = "ok"
    except RefitError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    thread.join(10)
    same = all(torch.equal(engine.state_dict()[k], v) for k, v in trainer.state_dict().items())
    # either the bytes were read before the file shrank (the refit is whole) or the refit
    # is refused naming the buffer; the receiver process lives on either way
    named = "error" in box and any(n in box["error"] for n in truncated)
    _say(
        bool(truncated) and ((outcome == "ok" and "report" in box and same) or named),
        f"sender: {outcome}; receiver: {box}; truncated {truncated}; weights equal {same}",
    )
    receiver.close()
    sender.close()


def one_pass_receiver_shrinks_its_arena_before_the_write() -> None:
    """After one one-pass refit (the trainer keeps the arena mapped), the receiver ACKs the next
    BEGIN, then truncates its registered arena file before the trainer writes into it: the
    trainer must raise a RefitError naming the file."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

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
    before_write = arena.before_write
    name = arena.registration().arena.name

    thread, box = _receive(receiver)
    sender.stream_weights_via_ipc_zmq(timeout_s=10)  # the trainer maps the arena and keeps it
    thread.join(10)
    assert "report" in box, box

    def ack_then_shrink() -> None:
        before_write()
        os.truncate(arena._live.path, 0)

    arena.before_write = ack_then_shrink  # type: ignore[method-assign]
    thread, box = _receive(receiver)
    try:
        sender.stream_weights_via_ipc_zmq(timeout_s=10)
        outcome = "ok"
    except RefitError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    thread.join(10)
    _say(
        name in outcome and "shrank" in outcome,
        f"sender: {outcome}; receiver: {box}",
    )
    # the receiver's own weights lived in the file it truncated: leave them unread
    os._exit(0)


SCENARIOS = {
    "staged": staged_sender_shrinks_its_buffer_mid_copy,
    "one_pass": one_pass_receiver_shrinks_its_arena_before_the_write,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()

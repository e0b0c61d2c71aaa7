"""An engine that re-points its parameters after the receiver was built (a ``.to()`` round trip,
``load_state_dict(assign=True)``) still gets every later refit, staged or one-pass (the
default): otherwise the old storage is written, success reported, and the model never changes."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender

pytestmark = pytest.mark.faults


class _Weights(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i in range(4):
            setattr(self, f"w{i}", nn.Parameter(torch.randn(8, 16, generator=gen)))


def _round_trip(engine: nn.Module) -> None:
    engine.to(torch.float64).to(torch.float32)


def _assign(engine: nn.Module) -> None:
    fresh = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    engine.load_state_dict(fresh, assign=True)


def _refit(sender: RefitSender, receiver: HFWeightReceiver, *, keep_staging: bool) -> Any:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(report=receiver.receive()), daemon=True)
    thread.start()
    sender.stream_weights_via_ipc_zmq(8 << 10, timeout_s=10, keep_staging=keep_staging)
    thread.join(10)
    return box.get("report")


@pytest.mark.parametrize("repoint", [_round_trip, _assign], ids=["to_round_trip", "assign"])
@pytest.mark.parametrize("keep_staging", [False, True])
@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("one_pass", [False, None], ids=["staged", "default"])
def test_a_refit_after_the_engine_re_points_its_parameters_lands_in_the_live_ones(
    repoint, keep_staging, atomic, one_pass
):
    trainer, engine = _Weights(1), _Weights(2)
    sender = RefitSender(lambda: trainer, torch.float32)
    receiver = HFWeightReceiver(
        engine,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=10,
        atomic=atomic,
        one_pass=one_pass,  # the default registers: a re-pointed module is registered again
    )
    try:
        assert _refit(sender, receiver, keep_staging=keep_staging) is not None
        repoint(engine)
        for step in range(2):  # the second refit reuses what the first one cached
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1.0)
            report = _refit(sender, receiver, keep_staging=keep_staging)
            assert report is not None and report.version == step + 2
            for name, want in trainer.state_dict().items():
                torch.testing.assert_close(engine.state_dict()[name], want, msg=name)
    finally:
        receiver.close()
        sender.close()


def test_a_module_that_lost_a_refit_name_after_re_pointing_is_refused_by_name():
    trainer, engine = _Weights(1), _Weights(2)
    sender = RefitSender(lambda: trainer, torch.float32)
    receiver = HFWeightReceiver(
        engine,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=10,
    )
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            receiver.receive()
        except Exception as exc:  # read below
            box["error"] = exc

    try:
        engine.w3 = nn.Parameter(torch.zeros(4, 4))  # re-pointed with another shape
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        with pytest.raises(Exception, match="w3"):
            sender.stream_weights_via_ipc_zmq(8 << 10, timeout_s=10)
        thread.join(10)
        assert "w3" in str(box.get("error")), box
    finally:
        receiver.close()
        sender.close()

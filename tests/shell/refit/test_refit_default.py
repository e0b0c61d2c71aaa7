"""The default refit: one-pass wherever the receiver can register its memory, staged elsewhere.

Both sides run with their defaults (``one_pass`` left out); which path ran is read from what
each side reports — a one-pass refit has no buckets and the receiver's weights live in its
registered /dev/shm arena; a staged one sends buckets and the weights stay where they were.
"""

import contextlib
import logging

import attrs
import pytest
import torch
from torch import nn

from policyworker.errors import RefitError
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender
from tests.helpers import eager_model, refit_through, tiny_qwen2_config


@contextlib.contextmanager
def _connected(model, target, dtype, **receiver_options):
    """A sender and a receiver, each with its default ``one_pass``; closed on exit."""
    sender = RefitSender(lambda: model, dtype)
    receiver = HFWeightReceiver(
        target,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=30,
        **receiver_options,
    )
    try:
        yield sender, receiver
    finally:
        receiver.close()
        sender.close()


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _in_shared_memory(tensor):
    """Whether ``tensor`` lives in a shared file mapping (the registered arena on CPU)."""
    ptr = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= ptr < high:
                return len(rest) >= 5 and rest[4].startswith("/dev/shm/")
    return False


def test_the_default_refit_of_a_module_is_one_pass_and_bitwise_equal_to_the_staged_refit(
    tmp_path,
):
    cfg = tiny_qwen2_config(tmp_path, tie=False)
    model = eager_model(cfg, 5)
    by_default = eager_model(cfg, 6).to(torch.bfloat16)
    by_staging = eager_model(cfg, 6).to(torch.bfloat16)
    with (
        _connected(model, by_default, torch.bfloat16) as (sender, receiver),
        _connected(model, by_staging, torch.bfloat16, one_pass=False) as (staged, staged_receiver),
    ):
        for version in (1, 2):
            report, box = refit_through(sender, receiver)
            assert "error" not in box, box
            assert report["version"] == version and report["num_buckets"] == 0  # one-pass
            staged_report, box = refit_through(staged, staged_receiver)
            assert "error" not in box, box
            assert staged_report["num_buckets"] >= 1  # a receiver that did not register
            got, want = _state(by_default), _state(by_staging)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), name
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        assert _in_shared_memory(by_default.model.layers[0].mlp.up_proj.weight)
        assert not _in_shared_memory(by_staging.model.layers[0].mlp.up_proj.weight)


def test_the_default_refit_of_a_load_weights_callable_is_staged_in_the_same_exchange(tmp_path):
    cfg = tiny_qwen2_config(tmp_path, tie=False)
    model = eager_model(cfg, 5)
    loaded = {}

    def load_weights(pairs):
        loaded.update((name, tensor.clone()) for name, tensor in pairs)

    with _connected(model, load_weights, torch.bfloat16) as (sender, receiver):
        for version in (1, 2):
            report, box = refit_through(sender, receiver)
            assert "error" not in box, box
            assert report["version"] == version and report["num_buckets"] >= 1  # staged
        want = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
        assert loaded.keys() == want.keys()
        assert all(torch.equal(loaded[n], want[n]) for n in want)
        # an explicit one-pass sender is still refused by name, and nothing is written
        with pytest.raises(RefitError, match="did not register"):
            refit_through(sender, receiver, one_pass=True)


class _Tied(nn.Module):
    """Two parameters sharing memory without being one parameter: no arena can hold one alone."""

    def __init__(self):
        super().__init__()
        base = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
        self.a = nn.Parameter(base)
        self.b = nn.Parameter(base[2:])


def test_a_module_that_cannot_register_falls_back_to_staged_and_an_explicit_choice_raises(
    caplog,
):
    model, target = _Tied(), _Tied()
    with torch.no_grad():
        model.a.mul_(2.0)
    sender = RefitSender(lambda: model, torch.float32)
    info = {"a": ((8, 4), torch.float32), "b": ((6, 4), torch.float32)}
    try:
        with pytest.raises(ValueError, match="share memory"):
            HFWeightReceiver(
                target, address=sender.get_zmq_address(), refit_info=info, one_pass=True
            )
        with caplog.at_level(logging.WARNING):
            receiver = HFWeightReceiver(target, address=sender.get_zmq_address(), refit_info=info)
        assert "staged refits only" in caplog.text and "share memory" in caplog.text
        try:
            # the sender's manifest is its own walk; the receiver was given the same names
            assert sender.prepare_refit_info().keys() == info.keys()
            report, box = refit_through(sender, receiver)
            assert "error" not in box, box
            assert report["num_buckets"] >= 1 and not _in_shared_memory(target.a)
        finally:
            receiver.close()
    finally:
        sender.close()


class _Weights(nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.small = nn.Parameter(torch.randn(128, generator=g))
        self.big = nn.Parameter(torch.randn(24, 32, generator=g))


def test_an_atomic_default_refit_that_fails_midway_leaves_the_previous_weights(monkeypatch):
    model, target = _Weights(1), _Weights(2)
    with _connected(model, target, torch.float32, atomic=True) as (sender, receiver):
        assert refit_through(sender, receiver)[0]["num_buckets"] == 0  # one-pass, version 1
        before = _state(target)
        with torch.no_grad():
            model.small.add_(1.0)
            model.big.add_(1.0)
        walk = sender.weight_stream

        def failing():
            stream = walk()

            def sources():
                yield next(stream.sources)
                raise OSError("disk on fire")

            return attrs.evolve(stream, sources=sources(), plain=None)  # read through sources

        monkeypatch.setattr(sender, "weight_stream", failing)
        with pytest.raises(OSError, match="disk on fire"):
            refit_through(sender, receiver)
        monkeypatch.setattr(sender, "weight_stream", walk)
        assert receiver.version == 1 and not receiver.stale
        after = _state(target)
        assert all(torch.equal(after[k], before[k]) for k in before)  # the previous version
        report, box = refit_through(sender, receiver)
        assert "error" not in box and report["version"] == 2 and report["num_buckets"] == 0
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in _state(target).items())

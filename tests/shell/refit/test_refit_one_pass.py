"""One-pass ZMQ refit on CPU: the sender casts straight into the receiver's registered arena.

The arena is a /dev/shm file mapped shared by both processes (or, in the thread tests, mapped
twice in one process), so these tests run the real sender, receiver and protocol code.
"""

import contextlib
import json

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from policyworker.errors import RefitError
from policyworker.functional.wire.codec import ProtocolError, RefitRejectedError
from policyworker.functional.wire.one_pass import encode_registration
from policyworker.shell.refit.one_pass import sender as one_pass_sender
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender
from policyworker.shell.refit.weight_applier import WeightApplier
from tests.helpers import (
    JsonCommandChild,
    eager_model,
    refit_through,
    serve_refit_in_thread,
    tiny_qwen2_config,
    tiny_qwen3_moe_config,
    write_refit_info,
)

CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file, load_file
from transformers import AutoConfig, AutoModelForCausalLM
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.functional.wire.codec import DTYPES_BY_NAME

def say(obj):
    print("@@" + json.dumps(obj), flush=True)

receiver = model = None
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "setup":
            if receiver is not None:
                receiver.close()
            config = AutoConfig.from_pretrained(cmd["config_dir"])
            config._attn_implementation = "eager"
            torch.manual_seed(4321)  # different weights from the trainer's
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
            with open(cmd["refit_info"]) as f:
                info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in json.load(f).items()}
            receiver = HFWeightReceiver(
                model, address=cmd["address"], refit_info=info, timeout_s=60.0,
                one_pass=cmd["one_pass"], atomic=cmd.get("atomic", False),
            )
            say({"ok": True})
        elif cmd["op"] == "receive":
            report = receiver.receive()
            with torch.no_grad():
                ids = load_file(cmd["batch"])["input_ids"]
                logprobs = torch.log_softmax(model(ids).logits.float(), -1)
            tied = model.config.tie_word_embeddings
            state = {
                k: v.clone() for k, v in model.state_dict().items()
                if k != "lm_head.weight" or not tied
            }
            save_file({"logprobs": logprobs, **state}, cmd["out"])
            say({"ok": True, "version": report.version, "stale": receiver.stale})
        elif cmd["op"] == "exit":
            break
    except Exception as exc:
        say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
"""

IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def _child_refit(child, sender, tmp_path, tag, **setup):
    """Build a receiver in `child`, refit it twice (the weights change between), return both."""
    info, batch = tmp_path / "info.json", tmp_path / "batch.safetensors"
    write_refit_info(sender.prepare_refit_info(), info)
    save_file({"input_ids": IDS}, batch)
    child.send(
        op="setup",
        config_dir=str(tmp_path),
        refit_info=str(info),
        address=sender.get_zmq_address(),
        **setup,
    )
    assert child.reply()["ok"]
    results = []
    for step in range(2):
        out = tmp_path / f"{tag}{step}.safetensors"
        child.send(op="receive", batch=str(batch), out=str(out))
        report = sender.stream_weights_via_ipc_zmq(timeout_s=60)
        answer = child.reply()
        assert answer["ok"] and answer["version"] == step + 1 and not answer["stale"], answer
        assert report["version"] == step + 1
        got = load_file(out)
        sender_model = sender._model_fn()
        for name, tensor in sender_model.state_dict().items():  # the trainer's own bf16 cast
            assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
        results.append(got)
        with torch.no_grad():
            sender_model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    return results


def test_one_pass_refit_across_processes_equals_the_staged_refit_bit_for_bit(tmp_path):
    cfg = tiny_qwen2_config(tmp_path, tie=False)
    staged_model, one_pass_model = eager_model(cfg, 5), eager_model(cfg, 5)
    staged = RefitSender(lambda: staged_model, torch.bfloat16)
    one_pass = RefitSender(lambda: one_pass_model, torch.bfloat16, one_pass=True)
    child = JsonCommandChild(CHILD)
    try:
        by_staging = _child_refit(child, staged, tmp_path, "staged", one_pass=False)
        by_one_pass = _child_refit(child, one_pass, tmp_path, "one", one_pass=True)
        for got, want in zip(by_one_pass, by_staging, strict=True):
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), name
    finally:
        child.close()
        staged.close()
        one_pass.close()


# ------------------------------------------------------------------- one-process protocol checks


class _Weights(nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.small = nn.Parameter(torch.randn(128, generator=g))
        self.big = nn.Parameter(torch.randn(24, 32, generator=g))
        self.steps = nn.Buffer(torch.arange(100, 228, dtype=torch.int64) + seed)
        self.flags = nn.Buffer(torch.tensor([True, False, bool(seed % 2)]))


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@contextlib.contextmanager
def _connected(model, target, dtype, *, timeout_s=30, **receiver_options):
    """A one-pass sender of `model` (cast to `dtype`) and a receiver writing into `target`,
    both closed on exit."""
    sender = RefitSender(lambda: model, dtype, one_pass=True)
    receiver = HFWeightReceiver(
        target,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=timeout_s,
        **{"one_pass": True, **receiver_options},
    )
    try:
        yield sender, receiver
    finally:
        receiver.close()
        sender.close()


@contextlib.contextmanager
def _pair(*, atomic=False, sender_dtype=torch.float32, receiver_one_pass=True):
    model, target = _Weights(1), _Weights(2).to(torch.bfloat16)
    if sender_dtype == torch.float32:
        target = _Weights(2)
    with _connected(model, target, sender_dtype, atomic=atomic, one_pass=receiver_one_pass) as (
        sender,
        receiver,
    ):
        yield model, target, sender, receiver


def test_one_pass_writes_the_arena_reports_the_version_and_opens_the_arena_once(monkeypatch):
    opened = []
    original = one_pass_sender.open_shared_buffer
    original_file = one_pass_sender.SharedFile

    def counting(ref):
        opened.append(ref)
        return original(ref)

    def counting_file(ref):  # a CPU arena is held by descriptor, then mapped
        opened.append(ref)
        return original_file(ref)

    monkeypatch.setattr(one_pass_sender, "open_shared_buffer", counting)
    monkeypatch.setattr(one_pass_sender, "SharedFile", counting_file)
    with _pair(sender_dtype=torch.bfloat16) as (model, target, sender, receiver):
        for version in (1, 2, 3):
            with torch.no_grad():
                model.small.add_(1.0)
                model.steps.add_(7)
            report, box = refit_through(sender, receiver)
            assert "error" not in box, box
            assert report["version"] == version and report["num_tensors"] == 4
            assert report["num_buckets"] == 0 and box["report"].version == version
            assert not receiver.stale
            for name, want in model.state_dict().items():
                assert torch.equal(
                    target.state_dict()[name], want.to(target.state_dict()[name].dtype)
                )
        assert len(opened) == 1  # registered once; later BEGINs are answered with the id alone
        arena = receiver.arena.tensor
        assert target.small.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_one_pass_of_a_fused_moe_model_writes_each_expert_into_its_slice(tmp_path):
    cfg = tiny_qwen3_moe_config()
    model = eager_model(cfg, 6)
    target = eager_model(cfg, 7).to(torch.bfloat16)
    with _connected(model, target, torch.bfloat16) as (sender, receiver):
        report, box = refit_through(sender, receiver)
        assert "error" not in box, box
        assert report["num_tensors"] == len(sender.prepare_refit_info())
        assert any(".experts.0." in name for name in sender.prepare_refit_info())  # split names
        got, want = target.state_dict(), model.state_dict()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor.to(got[name].dtype)), name


def test_a_staged_refit_into_a_registered_receiver_still_lands_in_the_live_weights():
    with _pair() as (model, target, sender, receiver):
        report, box = refit_through(sender, receiver, one_pass=False)
        assert "error" not in box and report["num_buckets"] >= 1
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in _state(target).items())
        with torch.no_grad():
            model.big.mul_(-1)
        report, box = refit_through(sender, receiver)  # and a one-pass one after it
        assert report["version"] == 2 and report["num_buckets"] == 0
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in _state(target).items())


def test_a_manifest_mismatch_after_registration_is_refused_before_any_write():
    with _pair() as (model, target, sender, receiver):
        assert refit_through(sender, receiver)[0]["version"] == 1
        before = _state(target)
        model.big = nn.Parameter(torch.randn(24, 33))  # the trainer's layout changed
        with torch.no_grad():
            model.small.add_(1.0)
        with pytest.raises(
            RefitRejectedError, match=r"manifest rejected.*'big' sent float32\[24, 33\]"
        ):
            refit_through(sender, receiver)
        assert all(torch.equal(v, before[k]) for k, v in _state(target).items())
        assert receiver.version == 1 and not receiver.stale


def test_a_one_pass_commit_reports_every_entry_and_a_changed_manifest_is_still_checked():
    model = _Weights(1)
    info = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    applier = WeightApplier(_Weights(2), info, atomic=False)
    manifest = tuple(applier.manifest_specs())
    want = (tuple(s.name for s in manifest), sum(s.nbytes for s in manifest))
    for version, announced in enumerate((manifest, manifest, list(manifest)), start=1):
        applier.begin(announced)  # the same accepted tuple twice (its report cached), then a list
        applier.expect_external_write()
        assert applier.stale
        report = applier.commit()
        assert (report.version, report.names, report.num_bytes) == (version, *want)
        assert report.num_tensors == len(manifest) and not applier.stale
    changed = (*manifest[:-1], attrs.evolve(manifest[-1], shape=(4,)))
    with pytest.raises(ProtocolError, match="manifest rejected"):
        applier.begin(changed)
    applier.begin(manifest)  # and the accepted one still commits with its own report
    applier.expect_external_write()
    assert (applier.commit().names, applier.version) == (want[0], 4)


def test_a_registration_that_does_not_fit_the_manifest_is_refused_by_the_sender_before_writing():
    with _pair() as (model, target, sender, receiver):
        before = _state(target)
        registration = receiver.arena.registration()
        bad = registration.destinations[:-1] + (
            registration.destinations[-1].__class__(
                registration.destinations[-1].name,
                torch.float64,
                registration.destinations[-1].shape,
                registration.destinations[-1].strides,
                0,
            ),
        )
        receiver.arena._registration = type(registration)(
            registration.id, registration.arena, None, registration.arena_bytes, bad
        )
        with pytest.raises(RefitError, match=r"does not fit this manifest; nothing was written"):
            refit_through(sender, receiver)
        assert all(torch.equal(v, before[k]) for k, v in _state(target).items())
        assert receiver.version == 0
        receiver.arena._registration = registration
        assert refit_through(sender, receiver)[0]["version"] == 1


def _failing_after(monkeypatch, sender, count):
    """The sender's next weight streams fail after ``count`` tensors (the trainer's disk burns)."""
    walk = sender.weight_stream

    def failing():
        stream = walk()

        def gen():
            for _ in range(count):
                yield next(stream.sources)
            raise OSError("disk on fire")

        return attrs.evolve(stream, sources=gen(), plain=None)  # read through sources

    monkeypatch.setattr(sender, "weight_stream", failing)
    return lambda: monkeypatch.setattr(sender, "weight_stream", walk)


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_sender_failing_midway_leaves_the_version_unchanged_and_the_next_refit_succeeds(
    monkeypatch, atomic
):
    monkeypatch.setattr(one_pass_sender, "_GROUP_TENSORS", 1)  # each tensor lands at once
    with _pair(atomic=atomic) as (model, target, sender, receiver):
        before = _state(target)
        healed = _failing_after(monkeypatch, sender, 2)
        with pytest.raises(OSError, match="disk on fire"):
            refit_through(sender, receiver)
        healed()
        assert receiver.version == 0
        written = sum(not torch.equal(v, before[k]) for k, v in _state(target).items())
        if atomic:  # the sender wrote the spare only: the live weights are the old version
            assert written == 0 and not receiver.stale
            assert torch.equal(receiver.arena.spare_view("small"), model.small.detach())
        else:  # some tensors were overwritten: reported, never silently mixed
            assert written >= 1 and receiver.stale
        report, box = refit_through(sender, receiver)
        assert "error" not in box and report["version"] == 1 and not receiver.stale
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in _state(target).items())


def test_the_receiver_reports_why_the_sender_aborted(monkeypatch):
    with _pair() as (model, target, sender, receiver):
        thread, box = serve_refit_in_thread(receiver)
        _failing_after(monkeypatch, sender, 1)
        with pytest.raises(OSError, match="disk on fire"):
            sender.stream_weights_via_ipc_zmq(timeout_s=30)
        thread.join(30)
        assert isinstance(box["error"], RefitError)
        assert "sender aborted" in str(box["error"]) and "disk on fire" in str(box["error"])


def test_a_receiver_that_did_not_register_refuses_one_pass_with_the_fix():
    with _pair(receiver_one_pass=False) as (model, target, sender, receiver):
        before = _state(target)
        with pytest.raises(RefitRejectedError, match=r"did not register.*one_pass=True"):
            refit_through(sender, receiver)
        assert all(torch.equal(v, before[k]) for k, v in _state(target).items())
        assert (
            refit_through(sender, receiver, one_pass=False)[0]["version"] == 1
        )  # staged still works
    with pytest.raises(ValueError, match="True needs a ZMQ address"):
        HFWeightReceiver(
            target, address=None, refit_info={"w": ((2,), torch.float32)}, one_pass=True
        )


def test_a_load_weights_receiver_cannot_register():
    model = _Weights(1)
    sender = RefitSender(lambda: model, torch.float32)
    try:
        with pytest.raises(ValueError, match="needs an nn.Module target"):
            HFWeightReceiver(
                lambda pairs: None,
                address=sender.get_zmq_address(),
                refit_info=sender.prepare_refit_info(),
                one_pass=True,
            )
        with pytest.raises(ValueError, match="one_pass 'yes' must be True, False or None"):
            sender.stream_weights_via_ipc_zmq(one_pass="yes")
    finally:
        sender.close()


def test_re_pointed_weights_invalidate_the_registration_and_the_next_refit_re_registers():
    with _pair() as (model, target, sender, receiver):
        assert refit_through(sender, receiver)[0]["version"] == 1
        held = sender._one_pass_writer.held_id
        target.big.data = target.big.data.clone()  # e.g. a reload: the weight left the arena
        with torch.no_grad():
            model.big.add_(3.0)
        assert refit_through(sender, receiver)[0]["version"] == 2
        assert sender._one_pass_writer.held_id not in ("", held)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in _state(target).items())
        arena = receiver.arena.tensor
        assert target.big.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_a_policy_worker_streams_one_pass_into_a_registered_hf_receiver(tiny_model_paths):
    from transformers import AutoModelForCausalLM

    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_config

    worker = PolicyWorker(make_config(tiny_model_paths["qwen2"]))
    torch.manual_seed(11)
    target = AutoModelForCausalLM.from_pretrained(tiny_model_paths["qwen2"]).eval()
    with torch.no_grad():
        for parameter in target.parameters():
            parameter.normal_()  # different weights from the worker's
    receiver = HFWeightReceiver(
        target,
        address=worker.get_zmq_address(),
        refit_info=worker.prepare_refit_info(),
        timeout_s=30,
        one_pass=True,
    )
    thread, box = serve_refit_in_thread(receiver)
    try:
        report = worker.stream_weights_via_ipc_zmq(timeout_s=30, one_pass=True)
        thread.join(30)
        assert "error" not in box and report["version"] == 1 and report["num_buckets"] == 0
        sent = dict(worker.model.state_dict())
        for name, tensor in target.state_dict().items():
            assert torch.equal(tensor, sent[name]), name
    finally:
        receiver.close()
        worker.shutdown()


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_sender_that_vanishes_midway_times_the_receiver_out_without_a_new_version(
    monkeypatch, atomic
):
    """No ABORT arrives (as if the trainer died after writing some tensors): the receiver's
    wait for COMPLETE times out, its version is unchanged (in place: reported stale), and the
    next refit goes through."""
    monkeypatch.setattr(one_pass_sender, "_GROUP_TENSORS", 1)
    with _pair(atomic=atomic) as (model, target, sender, receiver):
        receiver._socket.timeout_s = 2.0
        zmq = sender._zmq()
        monkeypatch.setattr(zmq, "_abort", lambda *args, **kwargs: None)  # it dies: no ABORT
        before = _state(target)
        thread, box = serve_refit_in_thread(receiver)
        healed = _failing_after(monkeypatch, sender, 2)
        with pytest.raises(OSError, match="disk on fire"):
            sender.stream_weights_via_ipc_zmq(timeout_s=30)
        healed()
        thread.join(30)
        assert "timed out" in str(box["error"]) or "no message" in str(box["error"]), box
        assert receiver.version == 0 and receiver.stale == (not atomic)
        if atomic:
            assert all(torch.equal(v, before[k]) for k, v in _state(target).items())
        monkeypatch.undo()
        # The receiver rebuilt its socket when it timed out: wait, as a restarted trainer would
        # have, until the old connection is gone and the new one in (docs/refit-protocol.md).
        assert zmq.wait_for_receivers(1, departed=1, timeout_s=10.0), (
            zmq.departed_receivers,
            zmq.connected_receivers(),
        )
        report, box = refit_through(sender, receiver)
        assert "error" not in box and report["version"] == 1 and not receiver.stale
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in _state(target).items())


class _ManyExperts(nn.Module):
    """Tens of thousands of small tensors under long names: a registration reply of several MiB
    (a large MoE's per-expert checkpoint names)."""

    def __init__(self, num_layers, num_experts):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            experts = nn.ModuleList()
            for _ in range(num_experts):
                expert = nn.Module()
                expert.down_projection_weight_of_a_large_mixture_of_experts = nn.Parameter(
                    torch.randn(2)
                )
                experts.append(expert)
            layer = nn.Module()
            layer.experts = experts
            self.layers.append(layer)


def test_a_registration_of_tens_of_thousands_of_tensors_reaches_the_sender():
    model, target = _ManyExperts(40, 1000), _ManyExperts(40, 1000)
    with _connected(model, target, torch.float32, timeout_s=60) as (sender, receiver):
        body, _ = encode_registration(receiver.arena.registration(), held_id=None)
        assert len(json.dumps(body)) > 4 << 20  # over the sender's old 4 MiB reply cap
        report, box = refit_through(sender, receiver)
        assert "error" not in box and report["num_tensors"] == 40_000
        assert torch.equal(
            target.layers[39].experts[999].down_projection_weight_of_a_large_mixture_of_experts,
            model.layers[39].experts[999].down_projection_weight_of_a_large_mixture_of_experts,
        )

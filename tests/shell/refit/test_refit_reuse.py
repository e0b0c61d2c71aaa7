"""What a steady-state refit reuses from the last one, and every change that must undo it.

A refit sender keeps its adapter walk (`AdapterStreams`), its copy groups and its one-pass
destination views between refits; a receiver checks where its module's tensors live once per
one-pass BEGIN (`ModuleTree` plus identity and address of each tensor). Each edit a trainer or
an engine can make in between (an adapter added or removed, a module or parameter replaced,
``.data =`` with the same or another shape, another dtype, another model, a reload on the
receiver) must reach the next refit: these tests make each edit and check the bytes that land,
against a fresh walk with nothing cached.
"""

from __future__ import annotations

import contextlib

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from policyworker.errors import RefitError
from policyworker.shell.model.lora import LinearLoRA
from policyworker.shell.refit.adapter_refit import (
    AdapterStreams,
    adapter_refit_info,
    adapter_stream,
)
from policyworker.shell.refit.live_state import ModuleTree
from policyworker.shell.refit.one_pass import sender as one_pass_sender
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender
from policyworker.shell.refit.weight_applier import _Where
from tests.helpers import refit_through, serve_refit_in_thread
from tests.shell.refit.test_live_state_dict import _tree

# ---------------------------------------------------------------------------------------------
# ModuleTree


def _edits(root: nn.Module) -> list:
    """Every single edit of `root`'s module tree a reading must see (as closures)."""
    parents = [m for m in root.modules() if m._modules]
    edits = []
    for parent in parents:
        keys = list(parent._modules)
        key = keys[0]

        def added(p=parent):
            p.add_module("added", nn.Module())

        def removed(p=parent, k=key):
            del p._modules[k]

        def replaced(p=parent, k=key):
            p._modules[k] = nn.Module()

        def unset(p=parent, k=key):
            p._modules[k] = None

        def renamed(p=parent, k=key):  # same objects in the same order, one name changed
            p._modules = {("renamed" if n == k else n): c for n, c in p._modules.items()}

        edits += [added, removed, replaced, renamed]
        if parent._modules[key] is not None:  # unsetting an unset slot changes nothing
            edits.append(unset)
        if len(keys) > 1:

            def reordered(p=parent):
                items = list(p._modules.items())
                p._modules = dict(items[1:] + items[:1])

            edits.append(reordered)
    return edits


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_module_tree_reading_sees_every_edit_of_the_tree_and_nothing_else(data):
    root = _tree(data, 0)
    before = ModuleTree.of(root)
    assert before.same_as(ModuleTree.of(root))
    with torch.no_grad():  # values and parameters are not the tree
        for param in root.parameters():
            param.add_(1.0)
    assert before.same_as(ModuleTree.of(root))
    edits = _edits(root)
    if edits:
        data.draw(st.sampled_from(edits))()
        assert not before.same_as(ModuleTree.of(root))


def test_a_module_tree_compares_modules_by_identity_not_equality():
    class AllEqual(nn.Module):
        def __eq__(self, other):
            return True

        __hash__ = nn.Module.__hash__

    root = nn.Module()
    root.child = AllEqual()
    before = ModuleTree.of(root)
    root.child = AllEqual()
    assert not before.same_as(ModuleTree.of(root))


# ---------------------------------------------------------------------------------------------
# The adapter stream of a refit sender


def _linear_lora(in_features: int, out_features: int, seed: int) -> LinearLoRA:
    layer = LinearLoRA(in_features, out_features, bias=False, dim=2, alpha=4.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero: random values make every tensor distinct
        layer.lora_A.weight.copy_(torch.randn(layer.lora_A.weight.shape, generator=g))
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g))
    return layer


def _lora_model() -> nn.Module:
    """Two blocks of LoRA ``q_proj``/``v_proj`` and a plain ``o_proj`` (an adapter can be
    added there)."""
    root = nn.Module()
    root.layers = nn.ModuleList()
    for i in range(2):
        block = nn.Module()
        block.q_proj = _linear_lora(8, 8, seed=10 * i)
        block.v_proj = _linear_lora(8, 4, seed=10 * i + 1)
        block.o_proj = nn.Linear(4, 8, bias=False)
        root.layers.append(block)
    return root


def _in_place(model):
    with torch.no_grad():
        model.layers[0].q_proj.lora_B.weight.add_(1.0)


def _data_same_shape(model):  # new storage, same shape: read live, no new walk needed
    weight = model.layers[1].v_proj.lora_A.weight
    weight.data = weight.data.clone() * 3.0


def _data_new_shape(model):  # a rank change through .data: new specs
    weight = model.layers[1].v_proj.lora_A.weight
    weight.data = torch.randn(3, weight.shape[1])


def _param_replaced(model):
    holder = model.layers[0].v_proj.lora_B
    holder.weight = nn.Parameter(torch.randn(holder.weight.shape))


def _adapter_replaced(model):
    model.layers[1].q_proj = _linear_lora(8, 8, seed=99)


def _adapter_added(model):
    model.layers[0].o_proj = _linear_lora(4, 8, seed=7)


def _adapter_removed(model):
    model.layers[1].q_proj = nn.Linear(8, 8, bias=False)


def _block_replaced(model):
    block = nn.Module()
    block.q_proj, block.v_proj = _linear_lora(8, 8, seed=5), _linear_lora(8, 4, seed=6)
    block.o_proj = nn.Linear(4, 8, bias=False)
    model.layers[0] = block


EDITS = {
    "in_place": _in_place,
    "data_same_shape": _data_same_shape,
    "data_new_shape": _data_new_shape,
    "param_replaced": _param_replaced,
    "adapter_replaced": _adapter_replaced,
    "adapter_added": _adapter_added,
    "adapter_removed": _adapter_removed,
    "block_replaced": _block_replaced,
}
# edits after which the specs object may be the one of the last refit
KEEPS_THE_WALK = {"in_place", "data_same_shape"}


def _assert_stream_is_the_fresh_walks(model, cache, dtype):
    """The cached stream sends what a walk with nothing cached sends, bit for bit."""
    cached = adapter_stream(model, dtype=dtype, cache=cache)
    fresh = adapter_stream(model, dtype=dtype)
    assert cached.specs == fresh.specs
    got, want = list(cached.sources), list(fresh.sources)
    assert [(s.name, s.dtype) for s in got] == [(s.name, s.dtype) for s in want]
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(got, want, strict=True))
    assert cached.plain is not None
    assert all(torch.equal(a, b.tensor) for a, b in zip(cached.plain, want, strict=True))
    return cached


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_every_edit_of_the_model_reaches_the_next_adapter_stream(edit):
    model, cache = _lora_model(), AdapterStreams()
    before = _assert_stream_is_the_fresh_walks(model, cache, torch.bfloat16)
    assert adapter_stream(model, dtype=torch.bfloat16, cache=cache).specs is before.specs
    EDITS[edit](model)
    after = _assert_stream_is_the_fresh_walks(model, cache, torch.bfloat16)
    assert (after.specs is before.specs) == (edit in KEEPS_THE_WALK)
    assert (after.key == before.key) == (edit in KEEPS_THE_WALK)


def test_another_dtype_or_another_model_gets_its_own_walk():
    model, cache = _lora_model(), AdapterStreams()
    bf16 = adapter_stream(model, dtype=torch.bfloat16, cache=cache)
    fp32 = _assert_stream_is_the_fresh_walks(model, cache, torch.float32)
    assert {s.dtype for s in fp32.specs} == {torch.float32} and fp32.specs is not bf16.specs
    other = _lora_model()
    _in_place(other)
    _assert_stream_is_the_fresh_walks(other, cache, torch.float32)


@settings(max_examples=25, deadline=None)
@given(edits=st.lists(st.sampled_from(sorted(EDITS)), max_size=6))
def test_a_cached_adapter_stream_equals_a_fresh_walk_after_any_sequence_of_edits(edits):
    model, cache = _lora_model(), AdapterStreams()
    _assert_stream_is_the_fresh_walks(model, cache, torch.bfloat16)
    for edit in edits:
        EDITS[edit](model)
        _assert_stream_is_the_fresh_walks(model, cache, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Adapter refits end to end (the receiver on a thread)


def _module_with(info) -> nn.Module:
    """A bare module whose state dict has exactly `info`'s names and shapes (zeros)."""
    root = nn.Module()
    for name, (shape, dtype) in info.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=dtype), False))
    return root


@contextlib.contextmanager
def _adapter_receiver(sender, model, **options):
    info = adapter_refit_info(model, dtype=sender.refit_dtype)
    target = _module_with(info)
    receiver = HFWeightReceiver(
        target, address=sender.get_zmq_address(), refit_info=info, timeout_s=30, **options
    )
    try:
        yield target, receiver
    finally:
        receiver.close()


def _adapter_refit(sender, receiver, **kwargs):
    thread, box = serve_refit_in_thread(receiver)
    try:
        stream = sender.adapter_stream()
        return sender.send(stream, stream.sources, buffer_size_bytes=0, timeout_s=30, **kwargs)
    finally:
        thread.join(30)
        assert "error" not in box, box


def _assert_received(target, model, dtype):
    """The receiver holds the model's adapters cast to `dtype`, bit for bit."""
    sent = {s.name: s.tensor.to(dtype) for s in adapter_stream(model, dtype=dtype).sources}
    got = dict(target.state_dict())
    assert got.keys() == sent.keys()
    assert all(torch.equal(got[n], t) for n, t in sent.items())


@pytest.mark.parametrize("one_pass", [None, False], ids=["one_pass", "staged"])
@pytest.mark.parametrize("edit", sorted(KEEPS_THE_WALK | {"param_replaced", "adapter_replaced"}))
def test_an_edit_that_keeps_the_manifest_lands_bit_for_bit_in_the_receiver(edit, one_pass):
    model = _lora_model()
    sender = RefitSender(lambda: model, torch.bfloat16, keep_staging=True)
    try:
        with _adapter_receiver(sender, model) as (target, receiver):
            for _ in range(2):  # the second refit is the steady state: everything reused
                _adapter_refit(sender, receiver, one_pass=one_pass)
                _assert_received(target, model, torch.bfloat16)
            EDITS[edit](model)
            _adapter_refit(sender, receiver, one_pass=one_pass)
            _assert_received(target, model, torch.bfloat16)
    finally:
        sender.close()


@pytest.mark.parametrize("edit", ["adapter_added", "adapter_removed", "data_new_shape"])
def test_an_edit_that_changes_the_manifest_is_refused_by_the_old_receiver_then_lands(edit):
    """Never a silent success: the receiver built for the old adapters refuses the new manifest
    by name, and one built for the new adapters receives them exactly."""
    model = _lora_model()
    sender = RefitSender(lambda: model, torch.bfloat16)
    try:
        with _adapter_receiver(sender, model) as (_, receiver):
            _adapter_refit(sender, receiver)
            EDITS[edit](model)
            thread, box = serve_refit_in_thread(receiver)
            stream = sender.adapter_stream()
            with pytest.raises(RefitError, match="manifest"):
                sender.send(stream, stream.sources, buffer_size_bytes=0, timeout_s=30)
            thread.join(30)
            assert "manifest" in str(box.get("error")) and receiver.version == 1
        with _adapter_receiver(sender, model) as (target, receiver):
            _adapter_refit(sender, receiver)
            _assert_received(target, model, torch.bfloat16)
    finally:
        sender.close()


@pytest.mark.parametrize("one_pass", [None, False], ids=["one_pass", "staged"])
def test_plain_sources_send_the_same_bytes_as_the_per_tensor_sources(one_pass):
    model = _lora_model()
    sender = RefitSender(lambda: model, torch.bfloat16)
    try:
        with _adapter_receiver(sender, model) as (target, receiver):
            stream = sender.adapter_stream()
            assert stream.plain is not None
            per_tensor = attrs.evolve(stream, plain=None)
            thread, _ = serve_refit_in_thread(receiver)
            sender.send(per_tensor, per_tensor.sources, buffer_size_bytes=0, timeout_s=30)
            thread.join(30)
            by_sources = {k: v.clone() for k, v in target.state_dict().items()}
            with torch.no_grad():
                for p in target.parameters():
                    p.zero_()
            _adapter_refit(sender, receiver, one_pass=one_pass)
            got = target.state_dict()
            assert all(torch.equal(got[k], v) for k, v in by_sources.items())
            _assert_received(target, model, torch.bfloat16)
    finally:
        sender.close()


def test_a_plain_write_that_fails_midway_leaves_an_atomic_receiver_on_its_version(monkeypatch):
    model = _lora_model()
    sender = RefitSender(lambda: model, torch.float32)
    try:
        with _adapter_receiver(sender, model, atomic=True) as (target, receiver):
            _adapter_refit(sender, receiver)
            before = {k: v.clone() for k, v in target.state_dict().items()}
            _in_place(model)
            original = one_pass_sender.run_copy_groups

            def fails_after_the_first_group(groups, **kwargs):
                original(groups[:1], **kwargs)
                raise OSError("copy engine on fire")

            monkeypatch.setattr(one_pass_sender, "run_copy_groups", fails_after_the_first_group)
            thread, box = serve_refit_in_thread(receiver)
            with pytest.raises(OSError, match="copy engine on fire"):
                stream = sender.adapter_stream()
                sender.send(stream, stream.sources, buffer_size_bytes=0, timeout_s=30)
            thread.join(30)
            assert "sender aborted" in str(box.get("error"))
            assert receiver.version == 1 and not receiver.stale
            assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
            monkeypatch.setattr(one_pass_sender, "run_copy_groups", original)
            _adapter_refit(sender, receiver)
            _assert_received(target, model, torch.float32)
    finally:
        sender.close()


# ---------------------------------------------------------------------------------------------
# The receiver: where its module's tensors live


class _Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.block = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("steps", torch.arange(5) + seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def _receiver_data_moved(target):
    target.block.weight.data = target.block.weight.data.clone()


def _receiver_param_replaced(target):
    target.norm.weight = nn.Parameter(target.norm.weight.detach().clone())


def _receiver_reloaded(target):  # new tensor objects in every slot
    state = {k: v.detach().clone() for k, v in target.state_dict().items()}
    target.load_state_dict(state, assign=True)


def _receiver_module_replaced(target):
    fresh = nn.Linear(6, 4)
    with torch.no_grad():
        fresh.weight.copy_(target.block.weight)
        fresh.bias.copy_(target.block.bias)
    target.block = fresh


def _receiver_buffer_replaced(target):
    target.steps = target.steps.clone()


RECEIVER_EDITS = {
    "data_moved": _receiver_data_moved,
    "param_replaced": _receiver_param_replaced,
    "reloaded": _receiver_reloaded,
    "module_replaced": _receiver_module_replaced,
    "buffer_replaced": _receiver_buffer_replaced,
}


@pytest.mark.parametrize("edit", list(RECEIVER_EDITS), ids=list(RECEIVER_EDITS))
def test_a_receiver_sees_each_re_pointing_of_its_module(edit):
    target = _Net(1)
    where = _Where(target)
    assert where.holds(target)
    with torch.no_grad():  # new values in place: still where they were
        target.block.weight.add_(1.0)
    assert where.holds(target)
    RECEIVER_EDITS[edit](target)
    assert not where.holds(target)


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "staged"])
@pytest.mark.parametrize("edit", list(RECEIVER_EDITS), ids=list(RECEIVER_EDITS))
def test_a_refit_after_the_receiver_re_pointed_its_weights_lands_in_the_live_ones(edit, one_pass):
    model, target = _Net(1), _Net(2)
    sender = RefitSender(lambda: model, torch.float32, keep_staging=True)
    receiver = HFWeightReceiver(
        target,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=30,
        one_pass=True,
    )
    try:
        for step in range(2):
            assert refit_through(sender, receiver, one_pass=one_pass)[0]["version"] == step + 1
        RECEIVER_EDITS[edit](target)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2.0)
            model.steps.add_(7)
        assert refit_through(sender, receiver, one_pass=one_pass)[0]["version"] == 3
        live = target.state_dict()
        assert all(torch.equal(live[k], v) for k, v in model.state_dict().items())
    finally:
        receiver.close()
        sender.close()


def test_a_one_pass_begin_walks_the_receivers_module_once(monkeypatch):
    model, target = _Net(1), _Net(2)
    sender = RefitSender(lambda: model, torch.float32)
    receiver = HFWeightReceiver(
        target, address=sender.get_zmq_address(), refit_info=sender.prepare_refit_info()
    )
    walks = []
    original = ModuleTree.of.__func__  # pyright: ignore[reportFunctionMemberAccess]

    def counting(cls, root):
        walks.append(root)
        return original(cls, root)

    try:
        refit_through(sender, receiver)
        monkeypatch.setattr(ModuleTree, "of", classmethod(counting))
        assert refit_through(sender, receiver)[0]["version"] == 2
        assert sum(w is target for w in walks) == 1
    finally:
        receiver.close()
        sender.close()


# ---------------------------------------------------------------------------------------------
# The full refit's plain sources


def test_a_full_refit_reads_re_pointed_sender_weights_and_keeps_its_copy_groups():
    model, target = _Net(1), _Net(2)
    sender = RefitSender(lambda: model, torch.bfloat16)
    receiver = HFWeightReceiver(
        target.to(torch.bfloat16),
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=30,
    )

    def check():
        assert "error" not in refit_through(sender, receiver)[1]
        live = target.state_dict()
        for k, v in model.state_dict().items():
            assert torch.equal(live[k], v.to(live[k].dtype)), k

    try:
        assert sender.weight_stream().plain is not None
        check()
        groups = sender._one_pass_writer._groups["plain"][2]
        check()
        assert sender._one_pass_writer._groups["plain"][2] is groups  # reused
        model.block.weight.data = model.block.weight.data * 5.0  # new storage, same object
        check()
        model.norm.bias = nn.Parameter(torch.randn(4))  # a new object: new groups
        check()
        assert sender._one_pass_writer._groups["plain"][2] is not groups
    finally:
        receiver.close()
        sender.close()

"""``live_state_dict`` is ``state_dict(keep_vars=True)``: same keys, order and tensor objects,
for any module tree, and torch's own walk wherever a module customises its state dict."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM

from policyworker.config import LoRAConfig
from policyworker.shell.model.lora import apply_lora
from policyworker.shell.refit.live_state import StateReader, live_state_dict
from policyworker.shell.refit.weight_stream import refit_stream
from tests.helpers import eager_model, save_tiny_llama, tiny_qwen2_config


def _assert_same_state(module: nn.Module, *, read_directly: bool | None = None) -> None:
    want = module.state_dict(keep_vars=True)
    got = live_state_dict(module)
    assert list(got) == list(want)
    assert all(got[k] is v for k, v in want.items())
    if read_directly is not None:  # whether the fast walk applied (or torch's was needed)
        assert StateReader().collect_plain_state(module, "", {}) is read_directly


_EXTRA = torch.tensor([7])
_DERIVED = torch.ones(1)


class _ExtraState(nn.Module):
    def get_extra_state(self):
        return _EXTRA  # one object, so the comparison by identity holds for it too

    def set_extra_state(self, state):
        pass


class _SavesMore(nn.Module):
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "derived"] = _DERIVED


def _patched_state_dict(module: nn.Module):
    def state_dict(*, destination=None, prefix="", keep_vars=False):
        out = nn.Module.state_dict(
            module, destination=destination, prefix=prefix, keep_vars=keep_vars
        )
        out[prefix + "patched"] = _DERIVED
        return out

    return state_dict


def _tree(data, depth: int) -> nn.Module:
    """A random module: parameters (some None), buffers (persistent or not, some None),
    children (some shared with a sibling, some None), and now and then a customised state dict."""
    kind = data.draw(
        st.sampled_from(["plain"] * 6 + ["extra", "saves_more", "hooked", "post_hooked", "patched"])
    )
    module = {"extra": _ExtraState, "saves_more": _SavesMore}.get(kind, nn.Module)()
    for i in range(data.draw(st.integers(0, 3))):
        shape = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2)))
        value = data.draw(st.sampled_from([None, nn.Parameter(torch.zeros(shape))]))
        module.register_parameter(f"p{i}", value)
    for i in range(data.draw(st.integers(0, 2))):
        value = data.draw(st.sampled_from([None, torch.zeros(2, dtype=torch.int64)]))
        module.register_buffer(f"b{i}", value, persistent=data.draw(st.booleans()))
    if kind == "hooked":
        module.register_state_dict_pre_hook(lambda *args: None)
    if kind == "post_hooked":  # adds a key after the module's own
        module.register_state_dict_post_hook(
            lambda module, state, prefix, metadata: state.update({prefix + "posted": _DERIVED})
        )
    if kind == "patched":  # an instance's own state_dict (as some wrappers install)
        module.state_dict = _patched_state_dict(module)
    children: list[nn.Module | None] = []
    for i in range(data.draw(st.integers(0, 3)) if depth < 3 else 0):
        shared = children and data.draw(st.booleans())
        child = data.draw(st.sampled_from(children)) if shared else _tree(data, depth + 1)
        children.append(child)
        module.add_module(f"c{i}", child)
    if data.draw(st.booleans()):
        module.add_module("gone", None)
    return module


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_equals_torchs_state_dict_for_any_module_tree(data):
    _assert_same_state(_tree(data, 0))


def test_hf_models_tied_untied_and_with_lora_adapters(tmp_path):
    llama = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "llama"))
    assert any(m._non_persistent_buffers_set for m in llama.modules())  # rotary inv_freq
    _assert_same_state(llama, read_directly=True)
    for tie in (True, False):
        qwen2 = eager_model(tiny_qwen2_config(tmp_path / f"q{tie}", tie=tie), seed=0)
        _assert_same_state(qwen2, read_directly=True)
    apply_lora(llama, LoRAConfig(dim=4, target_modules=("q_proj", "down_proj")))
    _assert_same_state(llama, read_directly=True)


def test_torchs_walk_runs_wherever_a_module_customises_its_state_dict():
    root = nn.Module()
    root.inner = nn.Linear(2, 2)
    calls = []
    root.inner.register_state_dict_pre_hook(lambda *args: calls.append(args[1]))
    assert list(live_state_dict(root)) == ["inner.weight", "inner.bias"] and calls == ["inner."]
    root.extra, root.more = _ExtraState(), _SavesMore()
    assert list(live_state_dict(root))[-2:] == ["extra._extra_state", "more.derived"]


def test_a_refit_stream_reads_the_live_parameters_after_one_is_replaced():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    first = {s.name: s.tensor for s in refit_stream(model, torch.float32).sources}
    model[1].weight = nn.Parameter(torch.full((2, 3), 5.0))  # same shape: the walk is reused
    again = {s.name: s.tensor for s in refit_stream(model, torch.float32).sources}
    assert again["1.weight"].eq(5.0).all() and not first["1.weight"].eq(5.0).all()


def test_a_reader_s_class_cache_is_its_own():
    """Two readers share nothing: a class customised after one reader met it is seen afresh by
    a new reader (the owner decides how long its cache lives)."""

    class Late(nn.Linear):
        pass

    module = nn.Sequential(Late(2, 2))
    first = StateReader()
    assert first.collect_plain_state(module, "", {})
    Late.get_extra_state = lambda self: 1  # customised after the first reader met it
    assert not StateReader().collect_plain_state(module, "", {})
    assert list(StateReader().read(module)) == list(module.state_dict(keep_vars=True))

"""Collective refit over gloo: this process is trainer rank 0, two child processes are inference.

The two receiver processes (HF model or capture target, commands over stdin) are spawned once and
serve every multi-process check of this module, in order; the fault checks come last because
they break the group (the last one rebuilds a smaller group to show a refit works again).
One-process checks (plans, header decoding, watchdog, offload cycle) need no children.
"""

import copy
import json
import socket
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.buckets import TensorSpec
from policyworker.functional.wire.codec import DTYPES_BY_NAME, ProtocolError, RefitRejected
from policyworker.shell.refit import collective as C
from policyworker.shell.refit.watchdog import Watchdog
from policyworker.shell.refit.weight_stream import refit_info
from tests.helpers import (
    JsonCommandChild,
    eager_model,
    hf_built_dtype,
    router_weight_dtype,
    single_thread_logprobs,
    tiny_deepseek_v3_config,
    tiny_qwen2_config,
    write_refit_info,
)

CHILD = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file, load_file
from policyworker.shell.refit import collective as C
from policyworker.functional.wire.codec import DTYPES_BY_NAME

def say(obj):
    print("@@" + json.dumps(obj), flush=True)

def load_info(path):
    return {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in json.load(open(path)).items()}

group = receiver = model = None
captured = {}
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "init":
            group = C.init_collective(
                "127.0.0.1", cmd["port"], cmd["world"], train_world_size=1, rank=cmd["rank"],
                timeout_s=cmd.get("timeout_s", 30.0),
            )
            say({"ok": True})
        elif cmd["op"] == "poison_defaults":  # a receiver's local defaults must never matter
            C.CPU_DEFAULT_BUCKET_BYTES, C.DEFAULT_NUM_BUFFERS = 1000, 5
            say({"ok": True})
        elif cmd["op"] == "setup":
            from transformers import AutoConfig, AutoModelForCausalLM
            config = AutoConfig.from_pretrained(cmd["config_dir"])
            config._attn_implementation = "eager"
            torch.manual_seed(1234 + group.rank)  # weights differ from the trainer's
            dtype = DTYPES_BY_NAME[cmd["dtype"]]
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
            receiver = C.CollectiveWeightReceiver(
                model, group=group, refit_info=load_info(cmd["refit_info"]),
                atomic=cmd.get("atomic", False),
            )
            say({"ok": True})
        elif cmd["op"] == "setup_capture":
            model, captured = None, {}
            receiver = C.CollectiveWeightReceiver(
                lambda pairs: captured.update({n: t.clone() for n, t in pairs}), group=group,
                refit_info=load_info(cmd["refit_info"]))
            say({"ok": True})
        elif cmd["op"] == "receive":
            if cmd.get("die_after_buckets") is not None:
                apply, seen = receiver.receiver.apply_batch, [0]
                def dying(pairs):
                    seen[0] += 1
                    if seen[0] > cmd["die_after_buckets"]:
                        os._exit(3)
                    return apply(pairs)
                receiver.receiver.apply_batch = dying
            report = receiver.receive(refit_timeout_s=cmd.get("refit_timeout_s"))
            out = dict(captured)
            if model is not None:
                with torch.no_grad():
                    ids = load_file(cmd["batch"])["input_ids"]
                    out["logprobs"] = torch.log_softmax(model(ids).logits.float(), -1)
                out.update({k: v.contiguous() for k, v in model.state_dict().items()
                            if k != "lm_head.weight" or not model.config.tie_word_embeddings})
            save_file(out, cmd["out"])
            h = receiver.last_header
            say({"ok": True, "version": report.version, "num_buckets": report.num_buckets,
                 "stale": receiver.stale, "target_bytes": h.target_bytes,
                 "num_buffers": h.num_buffers, "layout": h.layout})
        elif cmd["op"] == "exit":
            # a broken group's stuck collective would block a normal exit until its timeout
            os._exit(0)
    except Exception as exc:
        stale = receiver.stale if receiver else None
        say({"ok": False, "error": f"{type(exc).__name__}: {exc}", "stale": stale})
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(children, *, timeout_s=30.0):
    """A fresh group: this process rank 0, children ranks 1.. (joins on a new port)."""
    port, world = _free_port(), len(children) + 1
    for rank, child in enumerate(children, start=1):
        child.send(op="init", port=port, world=world, rank=rank, timeout_s=timeout_s)
    group = C.init_collective(
        "127.0.0.1", port, world, train_world_size=1, rank=0, timeout_s=timeout_s
    )
    for child in children:
        assert child.reply()["ok"]
    return group


@pytest.fixture(scope="module")
def rig():
    children = [JsonCommandChild(CHILD), JsonCommandChild(CHILD)]
    try:
        yield {"children": children, "group": _init(children)}
    finally:
        for child in children:
            child.close()


IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def _receive_all(children, tmp_path, **cmd):
    for i, child in enumerate(children):
        child.send(
            op="receive",
            batch=str(tmp_path / "batch.safetensors"),
            out=str(tmp_path / f"out{i}.safetensors"),
            **cmd,
        )


def _answers(children, tmp_path):
    answers = [child.reply() for child in children]
    for answer in answers:
        assert answer["ok"], answer
    return answers, [load_file(tmp_path / f"out{i}.safetensors") for i in range(len(children))]


def _setup_models(children, tmp_path, info, *, dtype, atomic=(False, False)):
    write_refit_info(info, tmp_path / "info.json")
    save_file({"input_ids": IDS}, tmp_path / "batch.safetensors")
    for child, at in zip(children, atomic, strict=False):
        child.send(
            op="setup",
            config_dir=str(tmp_path),
            dtype=dtype,
            refit_info=str(tmp_path / "info.json"),
            atomic=at,
        )
    for child in children:
        assert child.reply()["ok"]


def _sources(model, dtype):
    from policyworker.shell.refit.weight_stream import iter_refit_sources

    return ((s.name, s.tensor) for s in iter_refit_sources(model, dtype))


# ------------------------------------------------------------------ two receivers, real processes


def test_fp32_refit_gives_bitwise_identical_logprobs_on_every_inference_rank(rig, tmp_path):
    children, group = rig["children"], rig["group"]
    model = eager_model(tiny_qwen2_config(tmp_path), 0)
    info = refit_info(model, torch.float32)
    _setup_models(children, tmp_path, info, dtype="float32", atomic=(True, False))
    for version in (1, 2):
        _receive_all(children, tmp_path, refit_timeout_s=30)
        report = group.broadcast_weights(
            _sources(model, torch.float32),
            refit_info=info,
            buffer_size_bytes=4096,
            num_buffers=3,
            refit_timeout_s=30,
        )
        answers, outs = _answers(children, tmp_path)
        assert report["num_buckets"] > 3 and report["num_buffers"] == 3
        for answer, out in zip(answers, outs, strict=True):
            assert answer["version"] == version and answer["num_buckets"] == report["num_buckets"]
            assert not answer["stale"]
            assert torch.equal(out["logprobs"], single_thread_logprobs(model, IDS))
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.add_(0.5)


def test_bf16_refit_of_fp32_master_equals_the_trainers_bf16_cast_in_legacy_layout(rig, tmp_path):
    children, group = rig["children"], rig["group"]
    model = eager_model(tiny_qwen2_config(tmp_path, tie=False), 1)
    info = refit_info(model, torch.bfloat16)
    _setup_models(children, tmp_path, info, dtype="bfloat16")
    _receive_all(children, tmp_path)
    report = group.broadcast_weights(
        _sources(model, torch.bfloat16),
        refit_info=info,
        buffer_size_bytes=3000,
        use_legacy_packing=True,
    )
    answers, outs = _answers(children, tmp_path)
    assert report["layout"] == "legacy" and sum(report["bucket_bytes"]) == report["num_bytes"]
    expected = single_thread_logprobs(copy.deepcopy(model).to(torch.bfloat16), IDS)
    for answer, out in zip(answers, outs, strict=True):
        assert answer["layout"] == "legacy" and torch.equal(out["logprobs"], expected)


def test_deepseek_router_bias_stays_fp32_through_a_bf16_refit(rig, tmp_path):
    children, group = rig["children"], rig["group"]
    cfg = tiny_deepseek_v3_config()
    cfg.save_pretrained(tmp_path)
    model = eager_model(cfg, 2)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    with torch.no_grad():
        bias.copy_(
            1.0 + 1e-3 * torch.arange(4, dtype=torch.float32)
        )  # steps a bf16 cast would erase
    info = refit_info(model, torch.bfloat16)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert info[name][1] == torch.float32
    _setup_models(children[:1], tmp_path, info, dtype="bfloat16")
    children[1].send(op="setup_capture", refit_info=str(tmp_path / "info.json"))
    assert children[1].reply()["ok"]
    _receive_all(children, tmp_path)
    group.broadcast_weights(
        _sources(model, torch.bfloat16), refit_info=info, buffer_size_bytes=2048
    )
    (_, _), (model_out, captured) = _answers(children, tmp_path)
    kept = hf_built_dtype(cfg, name, torch.bfloat16)  # the receiving model's own dtype
    assert model_out[name].dtype == kept and torch.equal(model_out[name], bias.to(kept))
    router = model_out["model.layers.1.mlp.gate.weight"]
    assert router.dtype == router_weight_dtype(model, torch.bfloat16)
    for key, (_, dtype) in info.items():  # the bytes that arrived carry exactly the metadata dtype
        assert captured[key].dtype == dtype, key


def test_receivers_plan_from_the_header_whatever_their_local_defaults(rig, tmp_path):
    children, group = rig["children"], rig["group"]
    info = {"w": (torch.Size([64, 64]), torch.float32), "b": (torch.Size([64]), torch.float32)}
    tensors = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    write_refit_info(info, tmp_path / "info.json")
    for child in children:
        child.send(op="poison_defaults")
        assert child.reply()["ok"]
    for kwargs in ({}, {"buffer_size_bytes": 3000, "num_buffers": 3}):
        for child in children:
            child.send(op="setup_capture", refit_info=str(tmp_path / "info.json"))
            assert child.reply()["ok"]
        _receive_all(children, tmp_path)
        report = group.broadcast_weights(list(tensors.items()), refit_info=info, **kwargs)
        answers, outs = _answers(children, tmp_path)
        for answer, out in zip(answers, outs, strict=True):
            assert (answer["target_bytes"], answer["num_buffers"]) == (
                report["target_bytes"],
                report["num_buffers"],
            )
            assert answer["num_buckets"] == report["num_buckets"]
            assert all(torch.equal(out[k], v) for k, v in tensors.items())
    assert report["target_bytes"] == 3000 and report["num_buckets"] == 2  # w (16 KiB) alone, then b


def _capture_round(children, group, tmp_path, tensors, dtypes=None, **kwargs):
    info = {n: (torch.Size(t.shape), (dtypes or {}).get(n, t.dtype)) for n, t in tensors.items()}
    write_refit_info(info, tmp_path / "info.json")
    for child in children:
        child.send(op="setup_capture", refit_info=str(tmp_path / "info.json"))
        assert child.reply()["ok"]
    _receive_all(children, tmp_path)
    report = group.broadcast_weights(list(tensors.items()), refit_info=info, **kwargs)
    _, outs = _answers(children, tmp_path)
    return report, outs


def test_legacy_packing_round_trip_and_reference_bucket_counts(rig, tmp_path):
    """Reference §19.6 cases, plus int/bool buffers that must keep their dtype and bits."""
    children, group = rig["children"], rig["group"]
    g = torch.Generator().manual_seed(5)
    tensors = {
        "scalar": torch.tensor(3.25, dtype=torch.bfloat16),
        "transposed": torch.randn(7, 5, generator=g).T,
        "half": torch.randn(33, generator=g).to(torch.float16),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bf": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "i32": torch.arange(-5, 4, dtype=torch.int32),
    }
    for legacy in (True, False):
        report, outs = _capture_round(
            children, group, tmp_path, tensors, buffer_size_bytes=2000, use_legacy_packing=legacy
        )
        for out in outs:
            for key, value in tensors.items():
                assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
    report, outs = _capture_round(
        children,
        group,
        tmp_path,
        {"big": torch.ones(1000, 1000)},
        buffer_size_bytes=100,
        use_legacy_packing=True,
    )
    assert report["bucket_bytes"] == [4_000_000]
    many = {f"t{i}": torch.full((10, 10), float(i)) for i in range(20)}
    report, outs = _capture_round(
        children, group, tmp_path, many, buffer_size_bytes=2000, use_legacy_packing=True
    )
    assert report["num_buckets"] > 1 and sum(report["bucket_bytes"]) == 20 * 400
    assert all(torch.equal(outs[1][k], v) for k, v in many.items())


def test_fp32_master_sent_as_bf16_is_cast_straight_into_the_bucket(rig, tmp_path):
    children, group = rig["children"], rig["group"]
    tensors = {"w": torch.randn(9, 13), "keep": torch.randn(4)}
    report, outs = _capture_round(
        children, group, tmp_path, tensors, {"w": torch.bfloat16}, buffer_size_bytes=600
    )
    for out in outs:
        assert out["w"].dtype == torch.bfloat16 and torch.equal(
            out["w"], tensors["w"].to(torch.bfloat16)
        )
        assert out["keep"].dtype == torch.float32 and torch.equal(out["keep"], tensors["keep"])


def test_a_rejected_manifest_stops_every_rank_before_any_write_and_the_group_stays_usable(
    rig, tmp_path
):
    children, group = rig["children"], rig["group"]
    tensors = {"a": torch.randn(4), "b": torch.randn(6)}
    write_refit_info({"a": ([4], "float32"), "b": ([5], "float32")}, tmp_path / "bad.json")
    write_refit_info({"a": ([4], "float32"), "b": ([6], "float32")}, tmp_path / "good.json")
    children[0].send(op="setup_capture", refit_info=str(tmp_path / "bad.json"))
    children[1].send(op="setup_capture", refit_info=str(tmp_path / "good.json"))
    assert children[0].reply()["ok"] and children[1].reply()["ok"]
    _receive_all(children, tmp_path)
    info = {n: (torch.Size(t.shape), t.dtype) for n, t in tensors.items()}
    start = time.monotonic()
    with pytest.raises(RefitRejected, match=r"rank\(s\) \[1\] rejected the header"):
        group.broadcast_weights(list(tensors.items()), refit_info=info)
    assert time.monotonic() - start < 5
    first, second = children[0].reply(), children[1].reply()
    assert not first["ok"] and "'b' sent float32[6] vs refit_info float32[5]" in first["error"]
    assert not second["ok"] and "rank(s) [1] rejected the header" in second["error"]
    _, outs = _capture_round(children, group, tmp_path, tensors)
    assert all(torch.equal(out["b"], tensors["b"]) for out in outs)


# ------------------------------------------------------------ faults (these break the group: last)


def test_receivers_that_never_join_raise_refit_timeout_within_the_deadline(rig):
    group = rig["group"]
    tensors = [("a", torch.randn(4))]
    start = time.monotonic()
    with pytest.raises(
        RefitTimeoutError,
        match=r"rank 0/3: no progress within 2 s in phase 'header[a-z ]*' with 2 peers",
    ):
        group.broadcast_weights(
            tensors, refit_info={"a": (torch.Size([4]), torch.float32)}, refit_timeout_s=2.0
        )
    assert time.monotonic() - start < 2.0 + 5.0
    with pytest.raises(RefitError, match="is broken"):
        group.broadcast_weights(tensors, refit_info={"a": (torch.Size([4]), torch.float32)})


def test_an_inference_rank_killed_mid_broadcast_raises_refit_timeout_then_a_new_group_refits(
    rig, tmp_path
):
    children = rig["children"]
    group = _init(children, timeout_s=20.0)
    tensors = {f"t{i}": torch.randn(256) for i in range(12)}
    info = {n: (torch.Size(t.shape), t.dtype) for n, t in tensors.items()}
    write_refit_info(info, tmp_path / "info.json")
    for child in children:
        child.send(op="setup_capture", refit_info=str(tmp_path / "info.json"))
        assert child.reply()["ok"]
    children[0].send(op="receive", out=str(tmp_path / "o0.safetensors"), refit_timeout_s=4.0)
    children[1].send(
        op="receive", out=str(tmp_path / "o1.safetensors"), refit_timeout_s=4.0, die_after_buckets=2
    )
    start = time.monotonic()
    with pytest.raises(RefitTimeoutError, match=r"rank 0/3: .* in phase '(bucket|apply status).*"):
        group.broadcast_weights(
            list(tensors.items()),
            refit_info=info,
            buffer_size_bytes=1024,
            num_buffers=2,
            refit_timeout_s=4.0,
        )
    assert time.monotonic() - start < 4.0 + 5.0
    survivor, dead = children[0].reply(timeout=30), children[1].reply(timeout=30)
    assert dead["returncode"] == 3
    assert not survivor["ok"] and survivor["error"].startswith(
        ("RefitTimeoutError", "RefitPeerLostError")
    )
    rig["children"] = children = children[:1]
    group = _init(children)  # recovery: a new group without the dead rank
    _, outs = _capture_round(children, group, tmp_path, tensors, refit_timeout_s=10.0)
    assert all(torch.equal(outs[0][k], v) for k, v in tensors.items())


# --------------------------------------------------------------------------- one process


@st.composite
def _specs(draw):
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.int8]
    n = draw(st.integers(1, 12))
    return [
        TensorSpec(
            f"t{i}",
            tuple(draw(st.lists(st.integers(0, 40), max_size=3))),
            draw(st.sampled_from(dtypes)),
        )
        for i in range(n)
    ]


@settings(max_examples=60)
@given(specs=_specs(), target=st.integers(1, 5000), legacy=st.booleans())
def test_plans_cover_every_tensor_once_in_order_within_their_bucket_bytes(specs, target, legacy):
    plan = C.plan_collective_buckets(
        specs, layout="legacy" if legacy else "aligned", target_bytes=target
    )
    assert [i for b in plan for i in b.indices] == list(range(len(specs)))
    for bucket in plan:
        ends = [o + specs[i].nbytes for i, o in zip(bucket.indices, bucket.offsets, strict=True)]
        assert bucket.nbytes == max(ends)
        if legacy:  # reference layout: back to back, no padding
            assert bucket.offsets[0] == 0 and list(bucket.offsets[1:]) == ends[:-1]
        else:  # every slice dtype-aligned; only a lone tensor exceeds the (aligned) target
            assert all(o % C.DEFAULT_ALIGNMENT == 0 for o in bucket.offsets)
            assert bucket.nbytes <= max(-(-target // 512) * 512, 0) or len(bucket.indices) == 1
    if legacy:
        assert sum(b.nbytes for b in plan) == sum(s.nbytes for s in specs)


@given(
    specs=_specs(),
    seq=st.integers(0, 100),
    legacy=st.booleans(),
    target=st.integers(1, 1 << 40),
    num_buffers=st.integers(1, 64),
)
def test_header_encode_then_decode_is_identity(specs, seq, legacy, target, num_buffers):
    header = C.CollectiveHeader(
        seq, "legacy" if legacy else "aligned", target, num_buffers, 512, tuple(specs)
    )
    assert C.decode_header(C.encode_header(header)) == header


@given(
    raw=st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=12), inner, max_size=6)
            ),
            max_leaves=20,
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_malformed_headers_raise_protocol_error_and_nothing_else(raw):
    with pytest.raises(ProtocolError):
        C.decode_header(raw)


def test_header_with_a_wrong_version_names_both_versions():
    body = json.loads(C.encode_header(C.CollectiveHeader(1, "aligned", 10, 2, 512, ())))
    body["version"] = 99
    with pytest.raises(
        ProtocolError, match=r"version 99.*speaks 'policyworker-collective-refit' version 1"
    ):
        C.decode_header(json.dumps(body).encode())


def test_watchdog_fires_without_kicks_and_stays_quiet_while_kicked():
    fired = threading.Event()
    with Watchdog(0.3, fired.set) as dog:
        for _ in range(8):
            time.sleep(0.05)
            dog.kick("busy")
        assert not fired.is_set()
        assert fired.wait(2.0) and dog.fired and dog.phase == "busy"
    with pytest.raises(ValueError, match="must be > 0"):
        Watchdog(0, fired.set)


def test_cpu_offload_cycle_warns_and_moves_back_even_when_the_transfer_raises():
    calls = []
    with (
        pytest.warns(UserWarning, match="cpu_offload adds an onload/offload cycle"),
        pytest.raises(RuntimeError, match="boom"),
        C.cpu_offload_cycle(
            True, lambda: calls.append("on"), lambda: calls.append("off"), transport="x"
        ),
    ):
        calls.append("send")
        raise RuntimeError("boom")
    assert calls == ["on", "send", "off"]
    with C.cpu_offload_cycle(False, None, None, transport="x"):
        pass


def test_argument_errors_name_the_argument_and_the_rule():
    with pytest.raises(ValueError, match="1 <= train_world_size < world_size"):
        C.init_collective("127.0.0.1", 1234, 2, train_world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"rank 5 must be an int in \[0, 3\)"):
        C.init_collective("127.0.0.1", 1234, 3, train_world_size=1, rank=5)
    with pytest.raises(ValueError, match="port 0 must be"):
        C.init_collective("127.0.0.1", 0, 3, train_world_size=1, rank=0)
    with pytest.raises(ValueError, match="call init_collective"):
        C.broadcast_model_weights(None, nn.Linear(2, 2), torch.float32)
    group = C.CollectiveRefit(
        None,
        store=None,
        rank=0,
        world_size=2,
        train_world_size=1,
        device=torch.device("cpu"),
        timeout_s=1.0,
    )
    with pytest.raises(ValueError, match="FP8 kvcache"):
        C.broadcast_model_weights(group, nn.Linear(2, 2), torch.float32, kv_scales={"a": 1.0})
    for kwargs, match in (
        ({"buffer_size_bytes": 0}, "buffer_size_bytes 0"),
        ({"num_buffers": 65}, "num_buffers 65"),
        ({"refit_timeout_s": -1}, "refit_timeout_s -1"),
    ):
        with pytest.raises(ValueError, match=match):
            group.broadcast_weights(
                [], refit_info={"a": (torch.Size([1]), torch.float32)}, **kwargs
            )
    with pytest.raises(ValueError, match="runs on inference ranks"):
        C.CollectiveWeightReceiver(
            lambda pairs: None, group=group, refit_info={"a": (torch.Size([1]), torch.float32)}
        )
    assert DTYPES_BY_NAME["bfloat16"] is torch.bfloat16

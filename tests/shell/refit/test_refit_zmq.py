"""ZMQ refit over shared memory: a real sender here, a real receiver in another process.

One receiver process (HF model, commands over stdin) serves every two-process check of this
module; protocol details that need no second process (ACK order, oversized tensors, buffers freed
before COMPLETE, atomic mode) run the receiver in a thread.
"""

import copy
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.functional.wire.codec import decode_request
from policyworker.shell.refit import zmq as zmq_ipc
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender
from policyworker.shell.refit.zmq import ipc_files, staging
from tests.helpers import (
    JsonCommandChild,
    eager_model,
    hf_built_dtype,
    router_weight_dtype,
    serve_refit_in_thread,
    single_thread_logprobs,
    tiny_deepseek_v3_config,
    tiny_qwen2_config,
    write_refit_info,
)

CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file, load_file
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.functional.wire.codec import DTYPES_BY_NAME

def say(obj):
    print("@@" + json.dumps(obj), flush=True)

def load_info(path):
    with open(path) as f:
        return {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in json.load(f).items()}

receiver = model = None
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "setup_discard":  # no model: a light process for fault injection
            info = load_info(cmd["refit_info"])
            receiver = HFWeightReceiver(
                lambda pairs: None, address=cmd["address"], refit_info=info, timeout_s=60.0
            )
            say({"ok": True})
        elif cmd["op"] == "setup":
            from transformers import AutoConfig, AutoModelForCausalLM
            if receiver is not None:
                receiver.close()
            config = AutoConfig.from_pretrained(cmd["config_dir"])
            config._attn_implementation = "eager"
            torch.manual_seed(1234)  # different weights from the trainer's
            dtype = DTYPES_BY_NAME[cmd["dtype"]]
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
            info = load_info(cmd["refit_info"])
            receiver = HFWeightReceiver(
                model, address=cmd["address"], refit_info=info,
                atomic=cmd.get("atomic", False), timeout_s=cmd.get("timeout_s", 60.0),
            )
            say({"ok": True})
        elif cmd["op"] == "receive":
            if cmd.get("die_after_buckets") is not None:
                server, handle, seen = receiver._server, receiver._server.handle, [0]
                def dying(frames):
                    if b'"kind":"bucket"' in bytes(frames[0]):
                        seen[0] += 1
                        if seen[0] > cmd["die_after_buckets"]:
                            os._exit(3)
                    return handle(frames)
                server.handle = dying
            report = receiver.receive()
            with torch.no_grad():
                ids = load_file(cmd["batch"])["input_ids"]
                logprobs = torch.log_softmax(model(ids).logits.float(), -1)
            state = {
                k: v.contiguous() for k, v in model.state_dict().items()
                if k != "lm_head.weight" or not model.config.tie_word_embeddings
            }
            save_file({"logprobs": logprobs, **state}, cmd["out"])
            say({"ok": True, "version": report.version, "num_buckets": report.num_buckets,
                 "stale": receiver.stale})
        elif cmd["op"] == "exit":
            break
    except Exception as exc:
        stale = receiver.stale if receiver else None
        say({"ok": False, "error": f"{type(exc).__name__}: {exc}", "stale": stale})
"""


@pytest.fixture(scope="module")
def child():
    proc = JsonCommandChild(CHILD)
    yield proc
    proc.close()


def _refit(child, sender, tmp_path, *, dtype, config_dir, ids, timeout_s=60.0, **setup):
    info_path, out, batch = (
        tmp_path / "info.json",
        tmp_path / "out.safetensors",
        tmp_path / "batch.safetensors",
    )
    write_refit_info(sender.prepare_refit_info(), info_path)
    save_file({"input_ids": ids}, batch)
    child.send(
        op="setup",
        config_dir=str(config_dir),
        dtype=dtype,
        refit_info=str(info_path),
        address=sender.get_zmq_address(),
        **setup,
    )
    assert child.reply()["ok"]
    child.send(op="receive", batch=str(batch), out=str(out))
    report = sender.stream_weights_via_ipc_zmq(timeout_s=timeout_s)
    answer = child.reply()
    assert answer["ok"], answer
    return report, load_file(out)


IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def test_fp32_refit_gives_bitwise_identical_logprobs_and_can_repeat(child, tmp_path):
    cfg = tiny_qwen2_config(tmp_path)
    model = eager_model(cfg, 0)
    sender = RefitSender(lambda: model, torch.float32)
    try:
        report, got = _refit(child, sender, tmp_path, dtype="float32", config_dir=tmp_path, ids=IDS)
        assert report["version"] == 1 and report["num_tensors"] == len(sender.prepare_refit_info())
        assert torch.equal(got["logprobs"], single_thread_logprobs(model, IDS))
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.add_(0.5)
        child.send(
            op="receive",
            batch=str(tmp_path / "batch.safetensors"),
            out=str(tmp_path / "out.safetensors"),
        )
        assert sender.stream_weights_via_ipc_zmq(timeout_s=60)["version"] == 2
        assert child.reply()["ok"]
        assert torch.equal(
            load_file(tmp_path / "out.safetensors")["logprobs"], single_thread_logprobs(model, IDS)
        )
    finally:
        sender.close()


def test_bf16_refit_of_fp32_master_equals_the_trainers_bf16_cast(child, tmp_path):
    cfg = tiny_qwen2_config(tmp_path, tie=False)
    model = eager_model(cfg, 1)
    sender = RefitSender(lambda: model, torch.bfloat16)
    try:
        _, got = _refit(child, sender, tmp_path, dtype="bfloat16", config_dir=tmp_path, ids=IDS)
        assert torch.equal(
            got["logprobs"], single_thread_logprobs(copy.deepcopy(model).to(torch.bfloat16), IDS)
        )
    finally:
        sender.close()


def test_deepseek_router_bias_arrives_in_fp32_and_metadata_matches_bytes(child, tmp_path):
    cfg = tiny_deepseek_v3_config()
    cfg.save_pretrained(tmp_path)
    model = eager_model(cfg, 2)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    with torch.no_grad():
        bias.copy_(
            1.0 + 1e-3 * torch.arange(4, dtype=torch.float32)
        )  # steps a bf16 cast would erase
    sender = RefitSender(lambda: model, torch.bfloat16)
    try:
        _, got = _refit(child, sender, tmp_path, dtype="bfloat16", config_dir=tmp_path, ids=IDS)
        name = "model.layers.1.mlp.gate.e_score_correction_bias"
        kept = hf_built_dtype(cfg, name, torch.bfloat16)  # the receiving model's own dtype
        assert got[name].dtype == kept and torch.equal(got[name], bias.to(kept))
        router = got["model.layers.1.mlp.gate.weight"]
        assert router.dtype == router_weight_dtype(model, torch.bfloat16)
        fused = got["model.layers.1.mlp.experts.gate_up_proj"]
        assert fused.dtype == torch.bfloat16
        assert torch.equal(fused, model.model.layers[1].mlp.experts.gate_up_proj.to(torch.bfloat16))
    finally:
        sender.close()


def test_receiver_killed_mid_stream_times_out_then_the_sender_refits_again(child, tmp_path):
    cfg = tiny_qwen2_config(tmp_path)
    model = eager_model(cfg, 3)
    sender = RefitSender(lambda: model, torch.float32)
    try:
        dying = JsonCommandChild(CHILD)
        info_path, batch = tmp_path / "info.json", tmp_path / "batch.safetensors"
        write_refit_info(sender.prepare_refit_info(), info_path)
        save_file({"input_ids": IDS}, batch)
        dying.send(op="setup_discard", refit_info=str(info_path), address=sender.get_zmq_address())
        assert dying.reply()["ok"]
        dying.send(
            op="receive", batch=str(batch), out=str(tmp_path / "x.safetensors"), die_after_buckets=1
        )
        start = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=r"rank 0.*phase 'bucket \d+'.*ipc://"):
            sender.stream_weights_via_ipc_zmq(buffer_size_bytes=16384, timeout_s=3.0)
        assert time.monotonic() - start < 3.0 + 5.0
        assert dying.reply()["returncode"] == 3
        _, got = _refit(child, sender, tmp_path, dtype="float32", config_dir=tmp_path, ids=IDS)
        assert torch.equal(got["logprobs"], single_thread_logprobs(model, IDS))
    finally:
        sender.close()


def test_manifest_violation_is_rejected_with_names_and_without_a_timeout_wait(child, tmp_path):
    cfg = tiny_qwen2_config(tmp_path)
    model = eager_model(cfg, 4)
    sender = RefitSender(lambda: model, torch.float32)
    try:
        info = sender.prepare_refit_info()
        info.pop("model.norm.weight")
        info["model.ghost.weight"] = (torch.Size([2]), torch.float32)
        write_refit_info(info, tmp_path / "info.json")
        child.send(
            op="setup",
            config_dir=str(tmp_path),
            dtype="float32",
            refit_info=str(tmp_path / "info.json"),
            address=sender.get_zmq_address(),
        )
        answer = child.reply()
        assert not answer["ok"] and "'model.ghost.weight': no such parameter" in answer["error"]
        start = time.monotonic()  # the refused receiver answers the next refit with its reason
        with pytest.raises(
            RefitError,
            match=r"rejected begin: the receiver refused refit_info "
            r"when it was built: .*'model\.ghost\.weight'",
        ):
            sender.stream_weights_via_ipc_zmq(timeout_s=30)
        assert time.monotonic() - start < 5
        # The refusal's socket closes after answering, and the receiver below connects to the
        # same address: wait until the sender has seen the old connection go (else BEGIN can be
        # lost on it; docs/refit-protocol.md, Faults).
        assert sender.wait_for_receivers(0, departed=1, timeout_s=10)
        good = sender.prepare_refit_info()
        bad = dict(good)
        bad["model.norm.weight"] = (
            torch.Size([5]),
            torch.float32,
        )  # the receiver expects another shape
        received = []
        receiver = HFWeightReceiver(
            received.extend, address=sender.get_zmq_address(), refit_info=bad, timeout_s=30
        )
        thread, box = serve_refit_in_thread(receiver)
        start = time.monotonic()
        with pytest.raises(
            RefitError,
            match=r"rejected begin: manifest rejected.*'model.norm.weight' sent float32\[32\]",
        ):
            sender.stream_weights_via_ipc_zmq(timeout_s=30)
        assert time.monotonic() - start < 5
        thread.join(10)
        assert isinstance(box["error"], RefitError) and "'model.norm.weight'" in str(box["error"])
        assert received == [] and receiver.version == 0
        receiver.close()
    finally:
        sender.close()


# ------------------------------------------------------------------ one-process protocol checks


class _Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Parameter(torch.randn(128))  # 512 bytes
        self.big = nn.Parameter(torch.randn(768))  # 3072 bytes: oversized for 2048-byte buffers
        self.steps = nn.Buffer(torch.arange(100, 228, dtype=torch.int64))  # 1024 bytes
        self.flags = nn.Buffer(torch.tensor([True, False, True]))
        self.grid = nn.Parameter(torch.randn(8, 4).t())  # non-contiguous source


def test_protocol_order_oversized_tensor_and_buffers_freed_before_complete(monkeypatch):
    model = _Buffers()
    sender = RefitSender(lambda: model, torch.float32)
    info = sender.prepare_refit_info()
    zmq = sender._zmq()
    log = []
    seen_files = set()
    original = zmq_ipc.RefitServer.handle

    def recording(self, frames):
        message = decode_request(frames)
        kind = type(message).__name__
        if kind == "Bucket":
            seen_files.add(message.buffer.name)
            log.append((kind, tuple(list(info)[i] for i in message.indices), message.used_bytes))
        else:
            log.append(
                (
                    kind,
                    zmq.live_staging_bytes,
                    sorted(
                        f for f in seen_files if os.path.exists(os.path.join(ipc_files.SHM_DIR, f))
                    ),
                )
            )
        return original(self, frames)

    monkeypatch.setattr(zmq_ipc.RefitServer, "handle", recording)
    got = {}
    receiver = HFWeightReceiver(
        lambda pairs: got.update({n: t.clone() for n, t in pairs}),
        address=sender.get_zmq_address(),
        refit_info=info,
        timeout_s=30,
    )
    thread, box = serve_refit_in_thread(receiver)
    try:
        sender.stream_weights_via_ipc_zmq(buffer_size_bytes=4096, timeout_s=30)
        thread.join(30)
        assert "error" not in box, box
        assert log[0][0] == "Begin" and log[-1] == (
            "Complete",
            0,
            [],
        )  # staging freed and unlinked first
        buckets = [entry[1:] for entry in log if entry[0] == "Bucket"]
        # the two 2048-byte ping-pong halves share one file: the second one's bytes end at 4096
        assert buckets == [(("small",), 512), (("big",), 3072), (("grid", "steps", "flags"), 4096)]
        assert len(seen_files) == 2  # one file for the pair, one for the oversized tensor
        for name, (shape, dtype) in info.items():  # metadata dtypes equal the bytes that arrived
            assert got[name].dtype == dtype and got[name].shape == shape
            assert torch.equal(got[name], model.state_dict()[name]), name
        assert got["steps"].dtype == torch.int64 and got["flags"].dtype == torch.bool
    finally:
        receiver.close()
        sender.close()


def _fail_sources_after(sender, count):
    """Make the sender's streams raise OSError("disk on fire") after `count` weight sources;
    returns the original stream method (assign it back to stop failing)."""
    original = sender._zmq().stream

    def failing_stream(specs, plan, sources, **kwargs):
        def sources_then_fail():
            for _ in range(count):
                yield next(sources)
            raise OSError("disk on fire")

        kwargs["plain"] = None  # read the tensors through the failing sources
        return original(specs, plan, sources_then_fail(), **kwargs)

    sender._zmq().stream = failing_stream
    return original


def test_atomic_receiver_keeps_the_previous_version_when_a_refit_aborts():
    model, target = _Buffers(), _Buffers()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    sender = RefitSender(lambda: model, torch.float32)
    receiver = HFWeightReceiver(
        target,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        atomic=True,
        timeout_s=30,
    )
    original = _fail_sources_after(sender, 3)
    thread, box = serve_refit_in_thread(receiver)
    try:
        with pytest.raises(OSError, match="disk on fire"):
            sender.stream_weights_via_ipc_zmq(buffer_size_bytes=4096, timeout_s=30)
        thread.join(10)
        assert isinstance(box.get("error"), RefitError) and "sender aborted" in str(box["error"])
        assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
        assert not receiver.stale and receiver.version == 0
        sender._zmq().stream = original
        thread, box = serve_refit_in_thread(receiver)
        sender.stream_weights_via_ipc_zmq(timeout_s=30)
        thread.join(10)
        assert box["report"].version == 1
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in target.state_dict().items())
    finally:
        receiver.close()
        sender.close()


def test_in_place_receiver_is_stale_after_a_partial_refit():
    model, target = _Buffers(), _Buffers()
    sender = RefitSender(lambda: model, torch.float32)
    receiver = HFWeightReceiver(
        target,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=30,
    )
    receiver.begin_refit(sender.prepare_refit_info())
    receiver.apply_batch([("small", model.small.detach())])
    with pytest.raises(RefitError, match="never arrived"):
        receiver.commit_refit()
    assert receiver.stale and torch.equal(target.small, model.small)
    report = receiver.apply_named_tensors(
        [
            (n, t.to(d))
            for n, t, (_, d) in zip(
                model.state_dict(),
                model.state_dict().values(),
                sender.prepare_refit_info().values(),
                strict=True,
            )
        ],
        manifest=sender.prepare_refit_info(),
    )
    assert report.version == 1 and not receiver.stale
    receiver.close()
    sender.close()


def test_bad_arguments_fail_before_any_message():
    sender = RefitSender(lambda: nn.Linear(2, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="FP8 KV-cache scales are unsupported"):
        sender.stream_weights_via_ipc_zmq(kv_scales={"k": 1.0})
    with pytest.raises(ValueError, match="buffer_size_bytes -1"):
        sender.stream_weights_via_ipc_zmq(buffer_size_bytes=-1)
    with pytest.raises(ValueError, match="keep_staging 'yes' must be True, False or None"):
        sender.stream_weights_via_ipc_zmq(keep_staging="yes")
    with pytest.raises(ValueError, match="keep_staging 1 must be a bool"):
        RefitSender(lambda: nn.Linear(2, 2), torch.bfloat16, keep_staging=1)
    address = sender.get_zmq_address()
    assert (
        address.startswith("ipc://")
        and oct(os.stat(os.path.dirname(address[6:])).st_mode & 0o777) == "0o700"
    )
    sender.close()


def test_keep_staging_reuses_buffers_and_mappings_and_frees_them_on_release_or_failure():
    model, target = _Buffers(), _Buffers()
    sender = RefitSender(lambda: model, torch.float32, keep_staging=True)
    receiver = HFWeightReceiver(
        target,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=30,
    )
    zmq = sender._zmq()

    def files():
        return sorted(f for f in os.listdir(ipc_files.SHM_DIR) if f.startswith("pw-refit-"))

    def refit(**kwargs):
        thread, box = serve_refit_in_thread(receiver)
        try:
            return sender.stream_weights_via_ipc_zmq(buffer_size_bytes=4096, timeout_s=30, **kwargs)
        finally:
            thread.join(30)

    baseline = set(files())
    try:
        assert refit()["version"] == 1
        kept = set(files()) - baseline
        # one file holds the two kept halves; the oversized tensor's own buffer was freed
        assert len(kept) == 1 and zmq.kept_staging_bytes == 4096
        assert receiver._server.open_buffers == 1
        with torch.no_grad():
            model.small.add_(1.0)
            model.steps.add_(5)
        assert refit()["version"] == 2
        assert set(files()) - baseline == kept and receiver._server.open_buffers == 1
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in target.state_dict().items())
        # keep_staging=False on one call: the kept buffers serve it, then go before COMPLETE
        assert refit(keep_staging=False)["version"] == 3
        assert set(files()) == baseline and zmq.kept_staging_bytes == 0
        assert receiver._server.open_buffers == 0
        refit()
        assert zmq.kept_staging_bytes == 4096
        sender.release_staging()
        receiver.release_buffers()
        assert (
            set(files()) == baseline
            and zmq.kept_staging_bytes == 0
            and receiver._server.open_buffers == 0
        )
        refit()
        original = zmq.stream

        def failing_stream(specs, plan, sources, **kwargs):
            def sources_then_fail():
                yield from (next(sources) for _ in range(3))
                raise OSError("disk on fire")

            kwargs["plain"] = None  # read the tensors through the failing sources
            return original(specs, plan, sources_then_fail(), **kwargs)

        zmq.stream = failing_stream
        with pytest.raises(OSError, match="disk on fire"):
            refit()
        assert (
            set(files()) == baseline and zmq.kept_staging_bytes == 0 and zmq.live_staging_bytes == 0
        )
        assert receiver._server.open_buffers == 0 and receiver.version == 5
    finally:
        receiver.close()
        sender.close()
    assert set(files()) == baseline


@pytest.mark.parametrize("large_numel", [staging.LARGE_COPY_NUMEL, 6])
def test_grouped_copy_casts_every_pair_whatever_the_mix_of_dtypes_and_layouts(
    monkeypatch, large_numel
):
    monkeypatch.setattr(staging, "LARGE_COPY_NUMEL", large_numel)
    g = torch.Generator().manual_seed(0)
    srcs = [
        torch.randn(4, 3, generator=g),
        torch.randn(3, 4, generator=g).t(),  # non-contiguous source
        torch.randint(0, 9, (5,), generator=g),
        torch.randn(2, generator=g, dtype=torch.float64),
        torch.randn(6, generator=g),
    ]
    dsts = [
        torch.empty(4, 3, dtype=torch.bfloat16),
        torch.empty(4, 3, dtype=torch.bfloat16),
        torch.empty(5, dtype=torch.int64),
        torch.empty(2, dtype=torch.float32),
        torch.empty(12, dtype=torch.float32)[::2],  # non-contiguous destination
    ]
    groups = zmq_ipc.copy_groups(dsts, srcs)
    alone = [len(d) for d, _ in groups if len(d) == 1 and d[0].numel() >= large_numel]
    assert len(alone) == sum(d.numel() >= large_numel for d in dsts)  # large pairs go one by one
    assert sorted(id(t) for d, _ in groups for t in d) == sorted(id(t) for t in dsts)
    zmq_ipc.grouped_copy_(dsts, srcs)
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src.to(dst.dtype))
    with pytest.raises(ValueError):
        zmq_ipc.grouped_copy_(dsts, srcs[:2])


def test_a_sender_failing_while_the_receiver_still_reads_aborts_cleanly_and_retries_at_once(
    monkeypatch,
):
    """The sender's sources fail right after it sent a bucket the receiver has not opened yet.

    The sender must let the receiver finish that bucket before it removes its staging, and must
    not leave an ABORT queued for the next refit: the receiver ends with the sender's reason and
    the very next refit goes through.
    """
    model, target = _Buffers(), _Buffers()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    sender = RefitSender(lambda: model, torch.float32)
    receiver = HFWeightReceiver(
        target,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        atomic=True,
        timeout_s=30,
    )
    original_handle = zmq_ipc.RefitServer.handle

    def slow_to_read_buckets(self, frames):
        if type(decode_request(frames)).__name__ == "Bucket":
            time.sleep(0.3)  # the sender has moved on to its next (failing) source meanwhile
        return original_handle(self, frames)

    monkeypatch.setattr(zmq_ipc.RefitServer, "handle", slow_to_read_buckets)
    original_stream = _fail_sources_after(sender, 1)  # bucket 0 ("small") is sent, then it fails
    thread, box = serve_refit_in_thread(receiver)
    try:
        with pytest.raises(OSError, match="disk on fire"):
            sender.stream_weights_via_ipc_zmq(buffer_size_bytes=4096, timeout_s=30)
        thread.join(10)
        assert isinstance(box.get("error"), RefitError), box
        assert "sender aborted" in str(box["error"]) and "disk on fire" in str(box["error"])
        assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
        sender._zmq().stream = original_stream
        thread, box = serve_refit_in_thread(receiver)
        sender.stream_weights_via_ipc_zmq(buffer_size_bytes=4096, timeout_s=30)
        thread.join(10)
        assert "error" not in box, box
        assert box["report"].version == 1
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in target.state_dict().items())
    finally:
        receiver.close()
        sender.close()


def test_wait_for_receivers_sees_a_replaced_receiver_come_and_go_and_times_out_otherwise():
    sender = zmq_ipc.ZmqIpcSender(rank=0)
    info = {"w": (torch.Size([4]), torch.float32)}
    try:
        start = time.monotonic()
        assert not sender.wait_for_receivers(1, timeout_s=0.2)  # nobody connects
        assert 0.2 <= time.monotonic() - start < 5
        old = HFWeightReceiver(lambda pairs: None, address=sender.address, refit_info=info)
        assert sender.wait_for_receivers(1, timeout_s=10)
        departed = sender.departed_receivers
        old.close()
        new = HFWeightReceiver(lambda pairs: None, address=sender.address, refit_info=info)
        assert sender.wait_for_receivers(1, departed=departed + 1, timeout_s=10)
        new.close()
        assert sender.wait_for_receivers(0, departed=departed + 2, timeout_s=10)
    finally:
        sender.close()


def test_an_exchange_is_one_threads_at_a_time_and_none_after_close():
    sender = zmq_ipc.ZmqIpcSender(rank=0)
    refusals: list[str] = []

    def second_thread() -> None:
        try:
            with sender.exchange("second", timeout_s=1):
                refusals.append("entered")
        except RefitError as exc:
            refusals.append(str(exc))

    with sender.exchange("first", timeout_s=1) as exchange:
        assert exchange.timeout_s == 1
        thread = threading.Thread(target=second_thread)
        thread.start()
        thread.join(10)
    assert len(refusals) == 1 and "second was called while another thread" in refusals[0]
    thread = threading.Thread(target=second_thread)
    thread.start()
    thread.join(10)
    assert refusals[1] == "entered"  # free again once the first exchange ended
    sender.close()
    with pytest.raises(RefitError, match="after close"), sender.exchange("late", timeout_s=1):
        pass

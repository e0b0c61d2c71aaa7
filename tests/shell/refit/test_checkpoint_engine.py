"""Checkpoint-engine refit with the collective backend: this process is the policy worker
(NeMo-RL's ``checkpoint_engine_rpc`` lifecycle), child processes are rollout ranks hosting an HF
model in ``CheckpointEngineRollout``, driven the way NeMo-RL's weight synchronizer drives them.
"""

import asyncio
import json
import pathlib
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from policyworker.errors import RefitError, RefitTimeoutError
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.distributed.launch import run_on_gloo
from tests.helpers import JsonCommandChild, single_thread_logprobs, write_refit_info
from tests.shell.conftest import make_config

CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from policyworker.functional.wire.codec import DTYPES_BY_NAME
from policyworker.shell.refit.checkpoint_engine import CheckpointEngineRollout

def say(obj):
    print("@@" + json.dumps(obj), flush=True)

rollout = model = None
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "setup":
            config = AutoConfig.from_pretrained(cmd["model_dir"])
            config._attn_implementation = "eager"
            torch.manual_seed(99)  # weights differ from the trainer's until a refit lands
            model = AutoModelForCausalLM.from_config(config).eval().to(cmd.get("device", "cpu"))
            info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in json.load(open(cmd["info"])).items()}
            rollout = CheckpointEngineRollout(model, refit_info=info, rank=cmd["rank"])
            say({"ok": True})
        elif cmd["op"] == "rpc":
            result = rollout.checkpoint_engine_rpc(cmd["method"], tuple(cmd.get("args", ())))
            say({"ok": True, "result": result})
        elif cmd["op"] == "receive":
            if cmd.get("die_after_buckets") is not None:  # whichever way a backend applies
                applier, seen = rollout.receiver.applier, [0]
                def dying(apply):
                    def counted(*args):
                        seen[0] += 1
                        if seen[0] > cmd["die_after_buckets"]:
                            os._exit(3)
                        return apply(*args)
                    return counted
                for name in ("apply_batch", "apply_indexed", "apply_prepared"):
                    setattr(applier, name, dying(getattr(applier, name)))
                # a one-pass refit sends no bucket: it dies at its BEGIN, before the ACK
                applier.expect_external_write = lambda: os._exit(3)
            ok = rollout.checkpoint_engine_rpc("update_weights_from_checkpoint_engine")
            with torch.no_grad():
                ids = load_file(cmd["batch"])["input_ids"].to(model.device)
                out = {"logprobs": torch.log_softmax(model(ids).logits.float(), -1).cpu()}
            out.update({k: v.cpu().contiguous() for k, v in model.state_dict().items()
                        if k != "lm_head.weight" or not model.config.tie_word_embeddings})
            save_file(out, cmd["out"])
            say({"ok": ok, "version": rollout.receiver.version,
                 "num_buckets": rollout.last_report.num_buckets})
        elif cmd["op"] == "exit":
            os._exit(0)  # a broken group's stuck collective would block a normal exit
    except Exception as exc:
        say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
"""

IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
ENGINE = {
    "backend": "collective",
    "bucket_size_bytes": 4096,
    "engine_kwargs": {"host": "127.0.0.1", "device": "cpu", "timeout_s": 30.0},
}


def rpc(worker, method, **kwargs):
    return asyncio.run(worker.checkpoint_engine_rpc(method, kwargs))


def child_rpc(child, method, *args):
    child.send(op="rpc", method=method, args=list(args))
    answer = child.reply()
    assert answer["ok"], answer
    return answer["result"]


@pytest.fixture(scope="module")
def worker(tiny_model_paths):
    return PolicyWorker(make_config(tiny_model_paths["qwen2"]), init_reference_model=False)


@pytest.fixture(scope="module")
def children(worker, tiny_model_paths, tmp_path_factory):
    """Two rollout processes, started once (the fault test kills the second one last)."""
    started = _children(2, worker, tiny_model_paths["qwen2"], tmp_path_factory.mktemp("rollout"))
    try:
        yield started
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        _close(started)


def _children(n, worker, model_dir, tmp_path, *, devices=None):
    write_refit_info(worker.prepare_refit_info(), tmp_path / "info.json")
    children = [JsonCommandChild(CHILD) for _ in range(n)]
    for i, child in enumerate(children):  # one engine per child: each is rank 0 of its own
        child.send(
            op="setup",
            model_dir=model_dir,
            info=str(tmp_path / "info.json"),
            rank=0,
            device=(devices or ["cpu"] * n)[i],
        )
    for child in children:
        assert child.reply()["ok"]
    return children


def _connect(worker, children, engine=ENGINE):
    """NeMo-RL's synchronizer setup: init (twice: idempotent), prepare, process groups."""
    rpc(worker, "init_checkpoint_engine", **engine)
    first = worker.checkpoint_engine
    rpc(worker, "init_checkpoint_engine", **engine)
    assert worker.checkpoint_engine is first
    args = (engine["backend"], engine["bucket_size_bytes"], engine["engine_kwargs"])
    for child in children:
        child_rpc(child, "init_checkpoint_engine", *args)
    policy_meta = [rpc(worker, "prepare_checkpoint_engine")]
    rollout_meta = [child_rpc(child, "prepare_checkpoint_engine") for child in children]
    assert policy_meta[0]["rank"] == 0 and all(m["rank"] == 0 for m in rollout_meta)
    metadata = policy_meta + rollout_meta
    for prefix, child in enumerate(children):
        child.send(
            op="rpc",
            method="init_checkpoint_engine_process_group",
            args=[prefix, 1, len(children), metadata],
        )
    rpc(
        worker,
        "init_checkpoint_engine_process_group",
        train_world_size=1,
        rollout_world_size=len(children),
        metadata=metadata,
    )
    for child in children:
        assert child.reply()["ok"]


def _receive(children, tmp_path, **cmd):
    save_file({"input_ids": IDS}, tmp_path / "batch.safetensors")
    for i, child in enumerate(children):
        child.send(
            op="receive",
            batch=str(tmp_path / "batch.safetensors"),
            out=str(tmp_path / f"out{i}.safetensors"),
            **cmd,
        )


def _trainer_logprobs(model_dir, weights):
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(weights, strict=False)  # a tied lm_head follows the embedding
    return single_thread_logprobs(model, IDS)


def _close(children):
    for child in children:
        child.close()


def one_of_two_rollout_ranks_killed_then_a_send_works(
    worker, live, model_dir, tmp_path, engine, *, dead_match, aborted_marker
):
    """Rollout rank 1 dies after one bucket while rank 0 lives: the policy rank's send raises
    `dead_match` within the timeout (5 s), rank 0's receive ends with a named error (the policy
    rank's abort, `aborted_marker`, or its own bounded wait), and after a new group the next
    send reaches rank 0 bit for bit."""
    (tmp_path / "dying").mkdir()
    (dying,) = _children(1, worker, model_dir, tmp_path / "dying")
    try:
        _connect(worker, [live, dying], engine)
        _receive([live], tmp_path)
        dying.send(
            op="receive",
            batch=str(tmp_path / "batch.safetensors"),
            out=str(tmp_path / "dead.safetensors"),
            die_after_buckets=1,
        )
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=dead_match):
            rpc(worker, "send_weights_via_checkpoint_engine")
        assert time.monotonic() - started < 15
        assert dying.reply()["error"] == "exited"
        aborted = live.reply(timeout=15)
        assert not aborted["ok"], aborted
        assert aborted_marker in aborted["error"] or "within 5 s" in aborted["error"]
    finally:
        _close([dying])
    rpc(worker, "finalize_checkpoint_engine")
    next_send_reaches(worker, live, tmp_path, engine)
    rpc(worker, "finalize_checkpoint_engine")


def next_send_reaches(worker, live, tmp_path, engine):
    """After a kill: the rollout rank that lived starts over with ``worker``, and the next send
    gives it the policy's tensors bit for bit."""
    live.send(op="rpc", method="finalize_checkpoint_engine", args=[])
    assert live.reply()["ok"]
    _connect(worker, [live], engine)
    _receive([live], tmp_path)
    rpc(worker, "send_weights_via_checkpoint_engine")
    assert live.reply()["ok"]
    got = load_file(tmp_path / "out0.safetensors")
    for name, tensor in worker._checkpoint_engine_params():
        assert torch.equal(got[name], tensor), name


def test_collective_lifecycle_one_policy_two_rollout_ranks_bitwise_fp32(
    worker, children, tiny_model_paths, tmp_path
):
    model_dir = tiny_model_paths["qwen2"]
    assert rpc(worker, "checkpoint_engine_total_memory_bytes") > 0
    assert child_rpc(children[0], "checkpoint_engine_total_memory_bytes") > 0
    _connect(worker, children)
    for version in (1, 2):
        _receive(children, tmp_path)
        assert rpc(worker, "send_weights_via_checkpoint_engine", kv_scales=None) is None
        answers = [child.reply() for child in children]
        assert all(a["ok"] and a["version"] == version for a in answers), answers
        assert answers[0]["num_buckets"] > 1  # 4096-byte buckets: the stream was split
        sent = dict(worker._checkpoint_engine_params())
        expected = _trainer_logprobs(model_dir, sent)
        for i in range(len(children)):
            got = load_file(tmp_path / f"out{i}.safetensors")
            for name, tensor in sent.items():
                assert torch.equal(got[name], tensor), name
            assert torch.equal(got["logprobs"], expected)
        worker._add_noise_to_weights()  # the next refit must carry new weights
    rpc(worker, "finalize_checkpoint_engine")
    for child in children:
        child_rpc(child, "finalize_checkpoint_engine")
    with pytest.raises(RefitError, match="needs a group"):
        rpc(worker, "send_weights_via_checkpoint_engine")


def _two_policy_ranks(rank, world_size, model_dir, tmp, engine, fails):
    """One policy rank of a dp2 worker: the lifecycle, metadata gathered over the group."""
    import torch.distributed as dist

    tmp = pathlib.Path(tmp)
    worker = PolicyWorker(make_config(model_dir), init_reference_model=False)
    assert worker.parallel.dp_size == world_size  # FSDP2-sharded: the send gathers
    rpc(worker, "init_checkpoint_engine", **engine)
    policy_meta = [None] * world_size
    dist.all_gather_object(policy_meta, rpc(worker, "prepare_checkpoint_engine"))
    assert [m["rank"] for m in policy_meta] == list(range(world_size))
    metadata = policy_meta + [json.loads((tmp / "rollout_meta.json").read_text())]
    if rank == 0:  # the driver's view, handed to the rollout rank
        (tmp / "meta.tmp").write_text(json.dumps(metadata))
        (tmp / "meta.tmp").rename(tmp / "meta.json")
    rpc(
        worker,
        "init_checkpoint_engine_process_group",
        train_world_size=world_size,
        rollout_world_size=1,
        metadata=metadata,
    )
    if fails:  # the rollout rank dies mid-refit: every policy rank raises, none hangs
        started = time.monotonic()
        expected = RefitTimeoutError if rank == 0 else RefitError
        with pytest.raises(expected) as caught:
            rpc(worker, "send_weights_via_checkpoint_engine")
        (tmp / f"error{rank}.txt").write_text(f"{time.monotonic() - started:.1f} {caught.value}")
        rpc(worker, "finalize_checkpoint_engine")
        return
    rpc(worker, "send_weights_via_checkpoint_engine")
    sent = dict(worker._checkpoint_engine_params())  # a gather on every rank
    if rank == 0:
        save_file(sent, tmp / "sent.safetensors")
    rpc(worker, "finalize_checkpoint_engine")


def test_two_policy_ranks_into_one_rollout_rank_bitwise_fp32(children, tiny_model_paths, tmp_path):
    run_two_policy_ranks(children[0], ENGINE, tiny_model_paths["qwen2"], tmp_path)


def run_two_policy_ranks(
    live, engine, model_dir, tmp_path, *, die_after_buckets=None, one_pass=False
):
    """A dp2 policy worker (forked gloo ranks) into the rollout process ``live`` (``one_pass``:
    the refit is expected to send no bucket)."""
    fails = die_after_buckets is not None
    args = (engine["backend"], engine["bucket_size_bytes"], engine["engine_kwargs"])
    child_rpc(live, "finalize_checkpoint_engine")
    child_rpc(live, "init_checkpoint_engine", *args)
    (tmp_path / "rollout_meta.json").write_text(
        json.dumps(child_rpc(live, "prepare_checkpoint_engine"))
    )
    answers = []

    def drive_rollout():  # NeMo-RL's driver: rollout calls run beside the policy ranks' calls
        deadline = time.monotonic() + 60
        while not (tmp_path / "meta.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        metadata = json.loads((tmp_path / "meta.json").read_text())
        live.send(op="rpc", method="init_checkpoint_engine_process_group", args=[0, 2, 1, metadata])
        answers.append(live.reply())
        _receive([live], tmp_path, die_after_buckets=die_after_buckets)
        answers.append(live.reply())

    thread = threading.Thread(target=drive_rollout, daemon=True)
    thread.start()
    run_on_gloo(_two_policy_ranks, 2, model_dir, str(tmp_path), engine, fails)
    thread.join(timeout=60)
    if fails:
        assert answers[1]["error"] == "exited", answers
        return [(tmp_path / f"error{r}.txt").read_text() for r in range(2)]
    assert len(answers) == 2 and all(a["ok"] for a in answers), answers
    assert answers[1]["num_buckets"] == 0 if one_pass else answers[1]["num_buckets"] > 1
    sent = load_file(tmp_path / "sent.safetensors")
    got = load_file(tmp_path / "out0.safetensors")
    for name, tensor in sent.items():
        assert torch.equal(got[name], tensor), name
    assert torch.equal(got["logprobs"], _trainer_logprobs(model_dir, sent))
    child_rpc(live, "finalize_checkpoint_engine")


def test_killed_rollout_rank_is_a_named_error_within_the_timeout_then_a_new_group_works(
    worker, children, tmp_path
):
    live, dying = children
    engine = {**ENGINE, "engine_kwargs": {**ENGINE["engine_kwargs"], "timeout_s": 10.0}}
    _connect(worker, [dying], engine)
    _receive([dying], tmp_path, die_after_buckets=1)
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError, match="collective refit rank 0/2"):
        rpc(worker, "send_weights_via_checkpoint_engine")
    assert time.monotonic() - started < 25
    assert dying.reply()["error"] == "exited"
    # NeMo-RL's recovery: finalize everywhere, then set the engine up again with live ranks.
    rpc(worker, "finalize_checkpoint_engine")
    child_rpc(live, "finalize_checkpoint_engine")
    worker._add_noise_to_weights()
    _connect(worker, [live], engine)
    _receive([live], tmp_path)
    rpc(worker, "send_weights_via_checkpoint_engine")
    answer = live.reply()
    assert answer["ok"], answer
    got = load_file(tmp_path / "out0.safetensors")
    for name, tensor in worker._checkpoint_engine_params():
        assert torch.equal(got[name], tensor), name

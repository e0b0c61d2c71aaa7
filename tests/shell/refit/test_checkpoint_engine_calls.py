"""Checkpoint-engine refit in one process: the backend registry, the worker's argument checks,
the offload hooks around a send, and a policy + rollout engine pair on two threads."""

import asyncio
import pathlib
import re
import sys
import threading
import types
import warnings

import pytest
import torch
from torch import nn

from policyworker.errors import RefitError
from policyworker.shell.refit.checkpoint_engine import (
    BACKENDS,
    CheckpointEngine,
    CheckpointEngineRollout,
    create_checkpoint_engine,
    known_backends,
)
from policyworker.shell.worker.checkpoint_engine_calls import CheckpointEngineCalls
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_config

CPU = {"host": "127.0.0.1", "device": "cpu", "timeout_s": 20.0}
CPU_OF = {"collective": CPU, "ipc": {"device": "cpu", "timeout_s": 20.0}}


@pytest.fixture(scope="module")
def worker(tiny_model_paths):
    return PolicyWorker(make_config(tiny_model_paths["llama"]), init_reference_model=False)


def rpc(target, method, **kwargs):
    return asyncio.run(target.checkpoint_engine_rpc(method, kwargs))


def test_unknown_backend_is_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown checkpoint-engine backend 'nccl'.*'collective'"):
        create_checkpoint_engine("nccl", bucket_size_bytes=1024, engine_kwargs={})
    assert "collective" in known_backends() and set(known_backends()) <= set(BACKENDS)


def test_nixl_is_refused_by_name_where_it_does_not_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # `import nixl` raises ImportError
    with pytest.raises(ValueError, match="backend 'nixl' is unavailable.*'nixl' package") as caught:
        create_checkpoint_engine("nixl", bucket_size_bytes=1024, engine_kwargs={})
    assert "known here: ['collective', 'ipc']" in str(caught.value)
    assert "nixl" not in known_backends()


def _fake_nixl(monkeypatch, version):
    """A stand-in `nixl` package of `version` (the engine reads nothing else before prepare)."""
    from policyworker.shell.refit.checkpoint_engine import nixl_link

    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", types.ModuleType("nixl._api"))
    monkeypatch.setattr(nixl_link, "installed_version", lambda *dists: version)


def test_nixl_of_an_unsupported_version_is_refused_by_name(monkeypatch):
    _fake_nixl(monkeypatch, "1.4.2")
    with pytest.raises(ValueError, match=r"nixl 1.4.2 is not supported .*>= 1.5, < 2.0"):
        create_checkpoint_engine("nixl", bucket_size_bytes=1024, engine_kwargs={})
    assert "nixl" not in known_backends()


def test_nixl_is_ours_and_nemo_rl_s_engine_stays_reachable_by_its_path(monkeypatch):
    from policyworker.shell.refit.checkpoint_engine.nixl import NixlCheckpointEngine
    from policyworker.shell.refit.checkpoint_engine.registry import NEMO_RL_NIXL

    _fake_nixl(monkeypatch, "1.5.1")
    assert "nixl" in known_backends()
    ours = create_checkpoint_engine("nixl", bucket_size_bytes=1024, engine_kwargs={"device": "cpu"})
    assert isinstance(ours, NixlCheckpointEngine) and ours.bucket_size == 1024

    class NIXLCheckpointEngine:  # NeMo-RL's constructor convention
        def __init__(self, *, bucket_size, **kwargs):
            self.bucket_size, self.kwargs = bucket_size, kwargs

    module_name, class_name = NEMO_RL_NIXL.split(":")
    theirs = types.ModuleType(module_name)
    theirs.NIXLCheckpointEngine = NIXLCheckpointEngine
    monkeypatch.setitem(sys.modules, module_name, theirs)
    made = create_checkpoint_engine(NEMO_RL_NIXL, bucket_size_bytes=64, engine_kwargs={"x": 1})
    assert type(made).__name__ == class_name and (made.bucket_size, made.kwargs) == (64, {"x": 1})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_size_bytes": 0, "engine_kwargs": {}}, "bucket_size_bytes 0 must be >= 1"),
        ({"bucket_size_bytes": 1.5, "engine_kwargs": {}}, "must be a positive int"),
        ({"bucket_size_bytes": 64, "engine_kwargs": {"port": 1}}, r"\['port'\] are not options"),
        ({"bucket_size_bytes": 64, "engine_kwargs": {"timeout_s": 0}}, "timeout_s 0 must be > 0"),
    ],
)
def test_bad_engine_arguments_are_refused_before_anything_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_checkpoint_engine("collective", **kwargs)


def test_a_module_class_path_loads_any_engine_class():
    engine = create_checkpoint_engine(
        "policyworker.shell.refit.checkpoint_engine.collective:CollectiveCheckpointEngine",
        bucket_size_bytes=64,
        engine_kwargs=CPU,
    )
    assert isinstance(engine, CheckpointEngine) and engine.bucket_size == 64


def test_kv_scales_are_refused_before_any_engine_or_transfer(worker):
    with pytest.raises(NotImplementedError, match="FP8 kvcache"):
        rpc(worker, "send_weights_via_checkpoint_engine", kv_scales={"k_scale": 1.0})


def test_worker_lifecycle_checks_name_the_fix(worker):
    with pytest.raises(RefitError, match="init_checkpoint_engine"):
        rpc(worker, "prepare_checkpoint_engine")
    with pytest.raises(ValueError, match=r"missing \['engine_kwargs'\]"):
        rpc(worker, "init_checkpoint_engine", backend="collective", bucket_size_bytes=64)
    rpc(
        worker,
        "init_checkpoint_engine",
        backend="collective",
        bucket_size_bytes=64,
        engine_kwargs=CPU,
    )
    with pytest.raises(ValueError, match="already has a 'collective' checkpoint engine"):
        rpc(
            worker,
            "init_checkpoint_engine",
            backend="other:Engine",
            bucket_size_bytes=64,
            engine_kwargs={},
        )
    meta = rpc(worker, "prepare_checkpoint_engine")
    assert meta["rank"] == 0 and meta["backend"] == "collective" and meta["host"] == "127.0.0.1"
    with pytest.raises(ValueError, match="metadata has 1 entries"):
        rpc(
            worker,
            "init_checkpoint_engine_process_group",
            train_world_size=1,
            rollout_world_size=1,
            metadata=[meta],
        )
    with pytest.raises(ValueError, match="unknown method 'frobnicate'.*send_weights"):
        rpc(worker, "frobnicate")
    rpc(worker, "finalize_checkpoint_engine")


class _RecordingEngine(CheckpointEngine):
    def __init__(self, fail):
        self.fail, self.sent = fail, []

    def prepare(self):
        return {}

    def init_policy_process_group(self, **kwargs):
        pass

    def init_rollout_process_group(self, **kwargs):
        pass

    async def send_weights(self, weights, *, refit_info=None):
        self.grad_enabled = torch.is_grad_enabled()
        self.sent = [(name, t.dtype, t.is_contiguous()) for name, t in weights]
        self.refit_info = refit_info
        if self.fail:
            raise RefitError("transfer failed")

    def receive_weights(self, receiver):
        raise AssertionError("policy side only")


class _OffloadedWorker(CheckpointEngineCalls):
    """A worker stand-in with cpu_offload on: counts the moves around a send."""

    def __init__(self, engine):
        self.model = nn.Linear(2, 1)
        self.moves = []
        self.checkpoint_engine = engine
        self.state = types.SimpleNamespace(
            cfg=types.SimpleNamespace(dtensor_cfg=types.SimpleNamespace(cpu_offload=True)),
            model=self.model,
            dtype=torch.float32,
            draft=types.SimpleNamespace(model=None),
            parallel=types.SimpleNamespace(rank=0, all_reduce_int=lambda value, **_: value),
            require_running=lambda call: None,
            reshard=lambda: None,
        )

    def _checkpoint_engine_params(self):
        for name, p in self.model.named_parameters():
            yield name, p.detach().float().contiguous()

    def move_to_cuda(self, model):
        self.moves.append("device")
        return model

    def move_to_cpu(self, model):
        self.moves.append("cpu")
        return model


@pytest.mark.parametrize("fail", [False, True])
def test_cpu_offload_moves_once_each_way_even_when_the_send_fails(fail):
    w = _OffloadedWorker(_RecordingEngine(fail))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fail:
            with pytest.raises(RefitError, match="transfer failed"):
                asyncio.run(w.send_weights_via_checkpoint_engine())
        else:
            asyncio.run(w.send_weights_via_checkpoint_engine())
    assert w.moves == ["device", "cpu"]
    assert any("cpu_offload adds an onload/offload cycle" in str(c.message) for c in caught)
    engine = w.checkpoint_engine
    assert engine.sent == [("weight", torch.float32, True), ("bias", torch.float32, True)]
    assert list(engine.refit_info) == ["weight", "bias"] and not engine.grad_enabled


@pytest.mark.parametrize(
    "extra",
    [{}, {"use_legacy_packing": True, "num_buffers": 3, "refit_timeout_s": 20.0}],
    ids=["aligned", "legacy-3-buffers-watchdog"],
)
def test_policy_and_rollout_engines_on_two_threads_stream_batches_without_refit_info(extra):
    """The NeMo-RL form on both sides: ``send_weights(generator)`` with no manifest given (the
    engine builds it) and ``receive_weight_batches`` on the rollout side."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3, bias=False))
    sent = {k: v.detach().clone() for k, v in model.state_dict().items()}
    options = {**CPU, **extra}
    policy = create_checkpoint_engine("collective", bucket_size_bytes=64, engine_kwargs=options)
    rollout = create_checkpoint_engine("collective", bucket_size_bytes=64, engine_kwargs=options)
    metadata = [policy.prepare(), rollout.prepare()]
    sizes = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
    got, errors = [], []

    def rollout_side():
        try:
            rollout.init_rollout_process_group(rollout_rank=0, **sizes)

            async def drain():
                info = {n: (t.shape, t.dtype) for n, t in sent.items()}
                async for batch in rollout.receive_weight_batches(refit_info=info):
                    got.append(batch)

            asyncio.run(drain())
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=rollout_side, daemon=True)
    thread.start()
    policy.init_policy_process_group(worker_rank=0, **sizes)
    report = asyncio.run(policy.send_weights(iter(list(sent.items()))))
    thread.join(timeout=30)
    assert not errors and not thread.is_alive()
    assert report["num_buckets"] == len(got) > 1
    assert report["layout"] == ("legacy" if extra else "aligned")
    assert report["num_buffers"] == extra.get("num_buffers", 2)
    received = dict(pair for batch in got for pair in batch)
    assert list(received) == list(sent)
    assert all(torch.equal(received[n], sent[n]) for n in sent)
    policy.finalize()
    rollout.finalize()
    with pytest.raises(RefitError, match="needs a group"):
        asyncio.run(policy.send_weights(iter(sent.items())))


def test_rollout_host_refuses_calls_before_its_engine_exists():
    host = CheckpointEngineRollout(nn.Linear(2, 1), refit_info={"weight": ((1, 2), torch.float32)})
    with pytest.raises(RefitError, match="init_checkpoint_engine"):
        host.checkpoint_engine_rpc("update_weights_from_checkpoint_engine")
    with pytest.raises(ValueError, match="rank -1"):
        CheckpointEngineRollout(nn.Linear(2, 1), refit_info={}, rank=-1)


@pytest.mark.parametrize("backend", ["collective", "ipc"])
def test_every_backend_join_is_checked_by_the_base_before_any_state(backend):
    engine = create_checkpoint_engine(backend, bucket_size_bytes=64, engine_kwargs=CPU_OF[backend])
    try:
        mine = engine.prepare()
        bad = {
            "metadata has 1 entries": [mine],
            "rollout rank 1 must be an int in": [mine, mine],
            f"every member's {backend} prepare\\(\\) result": [mine, {"backend": "nixl"}],
            r"members offer devices \['cpu', 'cuda'\]": [mine, {**mine, "device": "cuda"}],
        }
        for match, metadata in bad.items():
            rank = 1 if match.startswith("rollout rank") else 0
            with pytest.raises(ValueError, match=match):
                engine.init_rollout_process_group(
                    rollout_rank=rank, train_world_size=1, rollout_world_size=1, metadata=metadata
                )
            with pytest.raises(ValueError, match=match if rank == 0 else "policy rank 1"):
                engine.init_policy_process_group(
                    worker_rank=rank, train_world_size=1, rollout_world_size=1, metadata=metadata
                )
        # nothing joined, nothing closed: no group, no peers, the ipc sockets still bound
        assert getattr(engine, "group", None) is None and getattr(engine, "peers", None) is None
        assert backend == "collective" or engine.prepare()["addresses"] == mine["addresses"]
    finally:
        engine.finalize()


class HalfEngine(CheckpointEngine):
    """Only the abstract methods: its joins fall through to the base."""

    def prepare(self):
        return {}

    async def send_weights(self, weights, *, refit_info=None):
        return None

    def receive_weights(self, receiver):
        return None


def test_an_engine_without_joins_is_named_after_the_checks():
    with pytest.raises(ValueError, match="metadata has 0 entries"):
        HalfEngine().init_policy_process_group(
            worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=[]
        )
    with pytest.raises(NotImplementedError, match="HalfEngine implements neither"):
        HalfEngine().init_rollout_process_group(
            rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=[{}, {}]
        )


def test_ipc_refuses_more_rollout_ranks_than_the_policy_ranks_offer_sockets():
    engine = create_checkpoint_engine(
        "ipc", bucket_size_bytes=4096, engine_kwargs={"device": "cpu", "timeout_s": 5.0}
    )
    try:
        mine = engine.prepare()
        metadata = [mine, {**mine, "addresses": []}, {**mine, "addresses": []}]
        with pytest.raises(ValueError, match="rollout_world_size 2 needs more ipc sockets"):
            engine.init_policy_process_group(
                worker_rank=0, train_world_size=1, rollout_world_size=2, metadata=metadata
            )
    finally:
        engine.finalize()


def test_the_docs_example_runs():
    text = (pathlib.Path(__file__).parents[3] / "docs" / "checkpoint-engine.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/checkpoint-engine.md", "exec"), {})


def _serve_in_thread(rollout, metadata, refits, errors, **sizes):
    """A rollout rank on a thread: join, then serve ``refits`` refits (errors collected)."""

    def body():
        try:
            rollout.init_checkpoint_engine_process_group(0, 1, 1, metadata)
            for _ in range(refits):
                try:
                    rollout.update_weights_from_checkpoint_engine()
                except Exception as exc:  # the main thread asserts on it
                    errors.append(exc)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("atomic", [True, False])
def test_a_refit_broken_midway_leaves_an_atomic_rollout_serving_the_previous_weights(atomic):
    torch.manual_seed(0)
    trainer, served = nn.Linear(16, 16), nn.Linear(16, 16)
    info = {n: (t.shape, t.dtype) for n, t in trainer.state_dict().items()}
    options = {**CPU, "timeout_s": 3.0}
    rollout = CheckpointEngineRollout(served, refit_info=info, atomic=atomic)
    rollout.init_checkpoint_engine("collective", 512, options)
    policy = create_checkpoint_engine("collective", bucket_size_bytes=512, engine_kwargs=options)
    metadata = [policy.prepare(), rollout.prepare_checkpoint_engine()]
    errors = []
    thread = _serve_in_thread(rollout, metadata, 2, errors)
    policy.init_policy_process_group(
        worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
    )
    first = {n: t.clone() for n, t in trainer.state_dict().items()}
    asyncio.run(policy.send_weights(iter(first.items()), refit_info=info))

    def breaks_after_the_weight():
        yield "weight", first["weight"] + 1  # several 512-byte buckets: some are applied
        raise RuntimeError("the trainer failed mid-stream")

    with pytest.raises(RuntimeError, match="mid-stream"):
        asyncio.run(policy.send_weights(breaks_after_the_weight(), refit_info=info))
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RefitError), errors
    assert rollout.receiver.version == 1
    if atomic:  # nothing of the broken refit was written
        assert not rollout.receiver.stale
        assert torch.equal(served.weight, first["weight"])
    else:  # written in place: marked stale until the next complete refit
        assert rollout.receiver.stale
    policy.finalize()
    rollout.finalize_checkpoint_engine()


def test_lora_worker_sends_merged_weights_and_no_adapter_tensors(tiny_model_paths):
    from transformers import AutoModelForCausalLM

    lora = {"lora_cfg": {"target_modules": ["q_proj"], "dim": 4, "alpha": 8}}
    path = tiny_model_paths["llama"]
    w = PolicyWorker(make_config(path, dtensor_cfg=lora), init_reference_model=False)
    q_name = next(n for n in w.lora_module_names if n.endswith("q_proj"))
    q = w.model.get_submodule(q_name)
    with torch.no_grad():
        q.lora_B.weight.normal_()  # a trained adapter: the merge must show
    merged = q.weight + q.scale * (q.lora_B.weight @ q.lora_A.weight)
    info = w.prepare_refit_info()
    assert not any("lora" in name for name in info)
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rollout = CheckpointEngineRollout(served, refit_info=info)
    rollout.init_checkpoint_engine("collective", 4096, CPU)
    rpc(
        w, "init_checkpoint_engine", backend="collective", bucket_size_bytes=4096, engine_kwargs=CPU
    )
    metadata = [rpc(w, "prepare_checkpoint_engine"), rollout.prepare_checkpoint_engine()]
    errors = []
    thread = _serve_in_thread(rollout, metadata, 1, errors)
    rpc(
        w,
        "init_checkpoint_engine_process_group",
        train_world_size=1,
        rollout_world_size=1,
        metadata=metadata,
    )
    rpc(w, "send_weights_via_checkpoint_engine")
    thread.join(timeout=30)
    assert not errors and rollout.receiver.version == 1
    got = served.get_submodule(q_name).weight
    assert torch.allclose(got, merged, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, q.weight)
    rpc(w, "finalize_checkpoint_engine")


def test_ipc_send_before_joining_is_refused_not_a_silent_no_op():
    engine = create_checkpoint_engine(
        "ipc", bucket_size_bytes=4096, engine_kwargs={"device": "cpu", "timeout_s": 5.0}
    )
    with pytest.raises(RefitError, match="init_policy_process_group"):
        asyncio.run(engine.send_weights(iter([("w", torch.zeros(2))])))


class ForeignEngine:
    """An engine written against NeMo-RL's base: ``cls(bucket_size=, **kwargs)``, a stream-only
    ``send_weights`` and extra calls of its own."""

    def __init__(self, *, bucket_size, tag):
        self.bucket_size, self.tag, self.sent = bucket_size, tag, None

    def prepare(self):
        return {"agent": self.tag}

    def init_policy_process_group(self, *, worker_rank, **kwargs):
        self.worker_rank = worker_rank

    async def send_weights(self, weights):
        self.sent = [name for name, _ in weights]

    def describe(self, *, verbose=False):
        return f"{self.tag} verbose={verbose}"

    def finalize(self):
        pass


def test_a_module_class_engine_written_for_nemo_rl_runs_the_worker_lifecycle(worker):
    path = f"{__name__}:ForeignEngine"
    w = PolicyWorker.__new__(PolicyWorker)  # the module worker already holds a collective one
    w.state = worker.state
    rpc(w, "init_checkpoint_engine", backend=path, bucket_size_bytes=64, engine_kwargs={"tag": "x"})
    assert rpc(w, "prepare_checkpoint_engine") == {"agent": "x", "rank": 0}
    rpc(
        w,
        "init_checkpoint_engine_process_group",
        train_world_size=1,
        rollout_world_size=1,
        metadata=[{}, {}],
    )
    assert asyncio.run(w.send_weights_via_checkpoint_engine()) is None
    assert w.checkpoint_engine.sent == list(worker.prepare_refit_info())
    assert rpc(w, "describe", verbose=True) == "x verbose=True"  # forwarded to the engine

"""NeMo-RL's seed surface on the worker: names, constructor kwargs, base-class methods, hooks,
and SGLang refit into plain engines and Ray actor handles."""

import logging
import os
import socket
import sys

import pytest
import torch

import policyworker
from policyworker.shell.refit import sglang as S
from policyworker.shell.refit.weight_stream import refit_info
from policyworker.shell.worker.policy_worker import AutomodelPolicyWorkerImpl, PolicyWorker
from tests.shell.conftest import make_config

NEMO_RL_GPU_INFO_KEYS = {
    "rank",
    "world_size",
    "local_rank",
    "local_device_id",
    "global_device_id",
    "device_count",
    "device_name",
    "memory_allocated_mb",
    "memory_reserved_mb",
    "peak_memory_allocated_mb",
    "peak_memory_reserved_mb",
    "parameter_sample",
    "env_vars",
}


@pytest.fixture(scope="module")
def worker(tiny_model_paths):
    return PolicyWorker(make_config(tiny_model_paths["qwen2"]), init_reference_model=False)


def test_nemo_rl_names_exist():
    assert AutomodelPolicyWorkerImpl is PolicyWorker
    assert policyworker.AutomodelPolicyWorkerImpl is PolicyWorker


def test_constructor_takes_the_kwargs_nemo_rl_passes(tiny_model_paths, caplog):
    marker = object()
    with caplog.at_level(logging.INFO, logger="policyworker"):
        w = PolicyWorker(
            make_config(tiny_model_paths["llama"]),
            init_reference_model=False,
            worker_sharding_annotations=object(),
            pre_init_communication_queue=None,
            skip_weight_load=False,
            tokenizer=marker,
            processor=None,
        )
    assert w.tokenizer is marker
    line = next(r.getMessage() for r in caplog.records if "keyword arguments" in r.getMessage())
    assert "worker_sharding_annotations" in line and "skip_weight_load" in line


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"bogus": 1}, r"unexpected PolicyWorker keyword arguments \['bogus'\]"),
        ({"processor": object()}, "processor=object is not supported"),
    ],
)
def test_constructor_refuses_other_kwargs_before_building(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        PolicyWorker({"model_name": "/nonexistent/model"}, **kwargs)


def test_prepare_for_training_takes_any_arguments(worker):
    worker.model.eval()
    worker.prepare_for_training("ignored", keep_train_buffers=True)
    assert worker.model.training


def test_base_worker_methods_report_this_process(worker):
    info = worker.get_gpu_info()
    assert set(info) == NEMO_RL_GPU_INFO_KEYS
    assert (info["rank"], info["world_size"], info["device_name"]) == (0, 1, "cpu")
    ((name, sample),) = info["parameter_sample"].items()
    assert sample["shape"] == list(dict(worker.model.named_parameters())[name].shape)
    assert worker.report_device_id() == f"CPU-{socket.gethostname()}-{os.getpid()}"
    free = worker.get_free_memory_bytes()
    assert 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ip, gpu = worker.report_node_ip_and_gpu_id()
    assert socket.inet_aton(ip) and gpu == -1
    worker.reset_peak_memory_stats()
    assert worker.is_alive()


def test_dtensor_worker_hooks(worker):
    assert worker._get_replica_group() is None  # one process: no (cp, tp) group
    assert worker._local_coords() == {"tensor_parallel": 0, "context_parallel": 0}
    assert worker.dtype == torch.float32
    with worker._autocast_context():  # fp32 compute: no autocast, as in every forward
        assert not torch.is_autocast_enabled("cpu")
    worker.state.dtype = torch.bfloat16
    try:
        with worker._autocast_context():
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    finally:
        worker.state.dtype = torch.float32
    params = dict(worker._checkpoint_engine_params())
    assert set(params) == set(refit_info(worker.model, worker.dtype))
    embed = params["model.embed_tokens.weight"]
    assert embed.dtype == worker.dtype
    assert torch.equal(embed, worker.model.model.embed_tokens.weight.detach().to(worker.dtype))


class _ActorMethod:
    """Ray's dispatch contract: an actor handle's method must be called as `.remote(...)`;
    calling it directly raises (as Ray's ActorMethod does)."""

    def __init__(self, method):
        self._method = method

    def __call__(self, *args, **kwargs):
        raise TypeError("Actor methods cannot be called directly; use .remote()")

    def remote(self, **kwargs):
        return self._method(**kwargs)


class _HandleOf:
    def __init__(self, engine):
        self.update_weights_from_tensor = _ActorMethod(engine.update_weights_from_tensor)


def _engine_for(worker, seed):
    engine_model = type(worker.model)(worker.model.config)
    torch.manual_seed(seed)
    engine_model.apply(engine_model._init_weights)
    return engine_model, S.SGLangReceiverAdapter(
        engine_model, refit_info=refit_info(worker.model, torch.float32)
    )


@pytest.mark.parametrize("as_handle", [False, True], ids=["plain-engine", "actor-handle"])
def test_sglang_refit_reaches_plain_engines_and_actor_handles(worker, as_handle):
    engine_model, adapter = _engine_for(worker, seed=3)
    worker.set_rollout_num_gpus_per_engine(1)
    engine = _HandleOf(adapter) if as_handle else adapter
    worker.update_weights_to_sglang_colocated(
        rollout_engines=[engine], buffer_size_bytes=1 << 16, target_precision="fp32"
    )
    for name, tensor in worker.model.state_dict().items():
        torch.testing.assert_close(engine_model.state_dict()[name], tensor, rtol=0, atol=0)


class _ModelEngine:
    """A colocated engine process's view: a HF model behind the SGLang adapter."""

    def __init__(self, model, info):
        self.model = model
        self.adapter = S.SGLangReceiverAdapter(model, refit_info=info)

    def update_weights_from_tensor(self, **kwargs):
        return self.adapter.update_weights_from_tensor(**kwargs)

    def state(self):
        return {n: t.clone() for n, t in self.model.state_dict().items()}


@pytest.mark.slow
def test_sglang_refit_into_a_real_ray_actor(worker):
    ray = pytest.importorskip("ray")  # the `ray` extra; CI without it runs the handle test above
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # address="local": a private cluster, never one another process started on this machine
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    # CPU tensors cross processes by shared-memory name here: the default fd passing needs the
    # sender's multiprocessing authkey, which Ray's worker processes do not share (on GPU the
    # payload holds CUDA IPC handles instead).
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        engine_model, _ = _engine_for(worker, seed=4)
        info = refit_info(worker.model, torch.float32)
        actor = ray.remote(_ModelEngine).remote(engine_model, info)
        worker.set_rollout_num_gpus_per_engine(1)
        worker.update_weights_to_sglang_colocated(
            rollout_engines=[actor], buffer_size_bytes=1 << 16, target_precision="fp32"
        )
        received = ray.get(actor.state.remote(), timeout=120)
        for name, tensor in worker.model.state_dict().items():
            torch.testing.assert_close(received[name], tensor, rtol=0, atol=0)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
        ray.shutdown()

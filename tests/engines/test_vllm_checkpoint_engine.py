"""A real vLLM engine (CPU, fp32, its worker in another process) hosting the rollout side of a
checkpoint-engine refit: this process is the policy worker (NeMo-RL's ``checkpoint_engine_rpc``
lifecycle), vLLM's worker joins through ``collective_rpc`` and receives over the collective
(gloo) backend. One engine for the module."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engines.vllm_helpers import TINY_LLAMA, engine, require_vllm, tiny_model

require_vllm()

from policyworker.demo.options import VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.shell.engines.vllm import encode_refit_info  # noqa: E402
from policyworker.shell.worker.policy_worker import PolicyWorker  # noqa: E402
from tests.engines.test_vllm_refit import _mismatch  # noqa: E402
from tests.shell.conftest import make_config  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE = {
    "backend": "collective",
    "bucket_size_bytes": 64 << 10,
    "engine_kwargs": {"host": "127.0.0.1", "device": "cpu", "timeout_s": 60.0},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("vllm_ce") / "model"
    tiny_model(LlamaConfig(**TINY_LLAMA), seed=0).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llm(model_dir):
    with engine(model_dir) as llm:
        yield llm


def rpc(worker, method, **kwargs):
    return asyncio.run(worker.checkpoint_engine_rpc(method, kwargs))


def vllm_rpc(llm, method, *args):
    return llm.collective_rpc("checkpoint_engine_rpc", args=(method, list(args)))


def test_checkpoint_engine_send_makes_vllms_logprobs_the_trainers(llm, model_dir):
    # vLLM re-raises a worker's error as a plain Exception carrying its text
    with pytest.raises(Exception, match="before checkpoint_engine_set_refit_info"):
        vllm_rpc(llm, "prepare_checkpoint_engine")
    worker = PolicyWorker(make_config(model_dir), init_reference_model=False)
    pool = ThreadPoolExecutor(1)  # vLLM's blocking calls, beside the policy side's
    try:
        worker._add_noise_to_weights()
        _, before = _mismatch(worker, llm, seed=0)
        assert before > 10 * VLLM_FP32_TOLERANCE  # vLLM serves other weights until the refit
        llm.collective_rpc(
            "checkpoint_engine_set_refit_info",
            args=(encode_refit_info(worker.prepare_refit_info()),),
        )
        rpc(worker, "init_checkpoint_engine", **ENGINE)
        vllm_rpc(llm, "init_checkpoint_engine", *ENGINE.values())
        metadata = [rpc(worker, "prepare_checkpoint_engine")]
        metadata += vllm_rpc(llm, "prepare_checkpoint_engine")  # one per vLLM worker
        assert len(metadata) == 2 and metadata[1]["rank"] == 0
        joined = pool.submit(
            vllm_rpc, llm, "init_checkpoint_engine_process_group", 0, 1, 1, metadata
        )
        rpc(
            worker,
            "init_checkpoint_engine_process_group",
            train_world_size=1,
            rollout_world_size=1,
            metadata=metadata,
        )
        assert joined.result(timeout=120) == [None]
        for version in (1, 2):
            got = pool.submit(vllm_rpc, llm, "update_weights_from_checkpoint_engine")
            rpc(worker, "send_weights_via_checkpoint_engine")
            assert got.result(timeout=120) == [True]
            report = llm.collective_rpc("checkpoint_engine_last_report")[0]
            assert report["version"] == version and report["num_buckets"] > 1
            _, worst = _mismatch(worker, llm, seed=version)
            assert worst <= VLLM_FP32_TOLERANCE, worst
            worker._add_noise_to_weights()
    finally:
        rpc(worker, "finalize_checkpoint_engine")
        pool.submit(vllm_rpc, llm, "finalize_checkpoint_engine").result(timeout=60)
        pool.shutdown()
        worker.shutdown()

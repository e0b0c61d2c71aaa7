"""PolicyWorker under dp2, tp2 and dp2 x tp2 (gloo) == the same worker in one process.

For fixed, dynamic and packed batching (the short-row dp rank runs dummy microbatches): logprobs
(with top-k/top-p filters too), top-k (same ids), FP8 kv scales, the global loss and grad norm of
two `train` calls (NLL; ClippedPG with k3 KL), the weights after them and the reference-model
logprobs (fp32, atol 1e-5). Plus: a sharded checkpoint (dp2, tp2) loads into one process with
the same weights; a NaN loss on one rank skips the step on all; dp2 with FSDP2 CPU offload and
recompute; tp2 with sequence parallelism; LoRA under tp2; a ZMQ refit from a dp2 worker (then
one without a receiver: every rank raises, none hangs); a rank that raises ends the job quickly.
The single-process references run once, in the test process.
"""

import time

import pytest
import torch

from tests.distributed import workers
from tests.distributed.launch import run_on_gloo
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("worker_llama"))


@pytest.fixture(scope="module")
def references(llama_path):
    torch.set_num_threads(1)
    return workers.worker_references(llama_path, workers.WORKER_CASES + (workers.LORA_CASE,))


def test_worker_dp2_and_tp2_match_one_process(llama_path, references, tmp_path):
    checks = {
        "zmq_refit": True,
        "sequence_parallel": True,
        "cpu_offload": True,
        "nan_skip": True,
        "checkpoint": str(tmp_path),
    }
    run_on_gloo(workers.worker_parity, 2, llama_path, (1, 2), references, checks)


def test_worker_dp2_tp2_matches_one_process(llama_path, references):
    cases = {k: v for k, v in references.items() if k != workers.LORA_CASE[0]}
    run_on_gloo(workers.worker_parity, 4, llama_path, (2,), cases)


def test_a_worker_rank_that_raises_ends_the_job_within_seconds(llama_path):
    start = time.monotonic()
    with pytest.raises(Exception, match="sample_mask"):
        run_on_gloo(workers.worker_rank_raises, 2, llama_path)
    assert time.monotonic() - start < 30

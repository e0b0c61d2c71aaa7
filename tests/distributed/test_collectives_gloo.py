"""Vocab-parallel logprobs, sampling filters under TP, distributed top-k, CP gather, grad norm.

One launch per world size runs every check (a launch costs seconds on 2 cores).
"""

import importlib.util

import pytest

from tests.distributed import workers
from tests.distributed.launch import run_on_gloo

pytestmark = pytest.mark.distributed

HAVE_TOPK_CORE = importlib.util.find_spec("policyworker.functional.topk") is not None


@pytest.mark.parametrize(
    ("world_size", "vocab_sizes"),
    [(2, (50, 17)), (4, (64, 50, 5))],  # 17 % 2, 50 % 4 != 0; V=5 on 4 ranks leaves an empty shard
)
def test_collectives_match_single_process(world_size, vocab_sizes):
    run_on_gloo(workers.collectives_suite, world_size, vocab_sizes, HAVE_TOPK_CORE)

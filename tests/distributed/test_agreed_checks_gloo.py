"""Checks that refuse on one rank refuse on every rank, before any collective (2 gloo ranks).

`agreed_checks` on its own: no refusal passes everywhere; one rank's refusal raises on both (its
own error there, `PeerRefusedError` naming it and its reason on the other); two refusals each
raise their own; the process group works afterwards. Then a dp2 PolicyWorker whose rank 1 gets
an out-of-vocabulary id (get_logprobs, then train): both ranks raise at once instead of rank 0
waiting in FSDP2's first all-gather, and the next good call works on both.
"""

from __future__ import annotations

import pickle
import time

import pytest

from tests.distributed import workers
from tests.distributed.launch import run_on_gloo
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.distributed

# Well below the process group's 180 s timeout: a rank left waiting in a collective fails it.
WITHIN_S = 30.0


def _refuse_on(rank: int, refusing: tuple[int, ...]) -> None:
    if rank in refusing:
        msg = f"rank {rank}'s shard holds token id 999"
        raise ValueError(msg)


def agreed_checks_suite(rank: int, size: int) -> None:
    from policyworker.shell.parallel.agreed_checks import PeerRefusedError, agreed_checks
    from policyworker.shell.parallel.context import ParallelContext

    ctx = ParallelContext.from_environment(timeout_s=60)
    with agreed_checks(ctx, what="get_logprobs"):
        _refuse_on(rank, ())  # nobody refuses: nothing raised

    with pytest.raises(ValueError) as refused, agreed_checks(ctx, what="get_logprobs"):
        _refuse_on(rank, (1,))
    if rank == 1:
        assert type(refused.value) is ValueError, refused.value  # its own error, unchanged
        assert str(refused.value) == "rank 1's shard holds token id 999"
    else:
        assert isinstance(refused.value, PeerRefusedError) and refused.value.rank == 1
        back = pickle.loads(pickle.dumps(refused.value))  # as Ray hands it to the driver
        assert (type(back), back.rank, str(back)) == (PeerRefusedError, 1, str(refused.value))
        assert str(refused.value) == (
            "rank 1 refused its part of get_logprobs, so rank 0 stops too, before any "
            "collective: ValueError: rank 1's shard holds token id 999"
        )

    own = rf"^rank {rank}'s shard holds token id 999$"
    with pytest.raises(ValueError, match=own), agreed_checks(ctx, what="train"):
        _refuse_on(rank, (0, 1))

    assert ctx.all_reduce_int(rank + 1) == 3  # the group still works after the refusals


def test_one_ranks_refusal_raises_on_every_rank():
    start = time.monotonic()
    run_on_gloo(agreed_checks_suite, 2)
    assert time.monotonic() - start < WITHIN_S


def worker_bad_shard_on_rank_one(rank: int, size: int, path: str) -> None:
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.parallel.agreed_checks import PeerRefusedError
    from policyworker.shell.worker.policy_worker import PolicyWorker

    worker = PolicyWorker(workers._worker_config(path, tp_size=1))
    good = workers._worker_data()
    bad = workers._worker_data()
    if rank == 1:
        bad["input_ids"][1, 2] = 10_000  # the tiny llama's vocabulary is far smaller
    for call in (lambda: worker.get_logprobs(bad), lambda: worker.train(bad, NLLLoss())):
        with pytest.raises(ValueError, match="outside the model's vocabulary") as refused:
            call()
        assert isinstance(refused.value, PeerRefusedError) == (rank == 0), refused.value
        if rank == 0:
            assert refused.value.rank == 1
    out = worker.get_logprobs(good)["logprobs"]  # every rank left together: the mesh works
    assert out.shape == good["input_ids"].shape
    worker.shutdown()


def test_a_dp2_worker_with_one_bad_shard_refuses_on_both_ranks_and_stays_usable(tmp_path):
    path = save_tiny_llama(tmp_path / "llama")
    start = time.monotonic()
    run_on_gloo(worker_bad_shard_on_rank_one, 2, path)
    assert time.monotonic() - start < WITHIN_S * 2  # two worker builds on a busy 2-core host

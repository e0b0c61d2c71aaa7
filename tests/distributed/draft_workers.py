"""Per-rank bodies of the draft co-training gloo tests (module-level, so forked ranks run them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

LENGTHS = (16, 15, 11, 9, 5, 4, 3, 2)  # rank 1 gets the short rows: under packing, a dummy mb
BATCHINGS = {"fixed": {}, "packed": {"sequence_packing": {"train_mb_tokens": 32}}}
NUM_STEPS = 3
# dp2 changes only the order of fp32 sums (the gradient all-reduce, the packing of each rank's
# rows, the loss's partial sums). SGD keeps that noise at its size (Adam's first steps divide by
# sqrt(v) ~ |g|: a noise-level change of a near-zero gradient element moves that weight by up
# to lr, measured 9.6e-5 on one lm_head element under packing), so weights agree to 1e-6.
OPTIMIZER = {"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}}
ATOL = 1e-6


def draft_config(path, batching):
    from tests.shell.conftest import make_config

    return make_config(
        path,
        train_global_batch_size=8,
        train_micro_batch_size=2,
        draft={"loss_weight": 1.0},
        optimizer=OPTIMIZER,
        **BATCHINGS[batching],
    )


def draft_data():
    from tests.shell.worker.test_draft import _affine_batch

    data = _affine_batch(8, seed=21)
    data["input_lengths"] = torch.tensor(LENGTHS)
    data["token_mask"] = (torch.arange(16)[None] < data["input_lengths"][:, None]).float()
    return data


def _train(worker, data):
    from policyworker.functional.loss import NLLLoss

    losses = []
    for _ in range(NUM_STEPS):
        metrics = worker.train(data, NLLLoss())["all_mb_metrics"]
        losses.append(sum(metrics["draft_loss"]))
    draft = worker.state.draft.model.state_dict()
    return losses, {k: v.detach().clone() for k, v in draft.items()}


def draft_reference(path):
    """One process, the whole batch: each batching's draft losses and draft weights."""
    from policyworker.shell.worker.policy_worker import PolicyWorker

    out = {}
    for batching in BATCHINGS:
        torch.manual_seed(0)  # the fresh draft's initialization
        worker = PolicyWorker(draft_config(path, batching))
        out[batching] = _train(worker, draft_data())
        worker.shutdown()
    return out


def draft_dp2(rank, size, path, want, root):
    """dp2 on half the rows each == one process on all of them; the ranks' drafts are equal;
    a dp2 checkpoint holds that draft."""
    from policyworker.shell.worker.policy_worker import PolicyWorker

    rows = slice(rank * 4, rank * 4 + 4)
    for batching, (want_losses, want_draft) in want.items():
        torch.manual_seed(rank)  # different draft inits: rank 0's must win
        worker = PolicyWorker(draft_config(path, batching))
        data = {k: v[rows] for k, v in draft_data().items()}
        losses, draft = _train(worker, data)
        totals = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(totals)  # each rank's draft_loss is its share of the global loss
        torch.testing.assert_close(totals, torch.tensor(want_losses, dtype=torch.float64))
        worst = 0.0
        for name, value in want_draft.items():
            others = [torch.empty_like(value) for _ in range(size)]
            dist.all_gather(others, draft[name])
            assert all(torch.equal(o, draft[name]) for o in others), f"{batching}: {name} differs"
            worst = max(worst, float((draft[name] - value).abs().max()))
            torch.testing.assert_close(draft[name], value, atol=ATOL, rtol=0, msg=name)
        if rank == 0:
            print(f"dp2 {batching}: draft weights max |dp2 - one process| = {worst:.2e}")
        if batching == "fixed":
            _check_checkpoint(worker, path, draft, f"{root}/{batching}")
        worker.shutdown()


def _check_checkpoint(worker, path, draft, root):
    """A dp2 save (the replicated draft written once) loads into one process: the same draft."""
    from policyworker.shell.parallel.context import ParallelContext
    from policyworker.shell.worker.policy_worker import PolicyWorker

    worker.save_checkpoint(f"{root}/weights", f"{root}/optimizer")
    worker.finalize_async_save()
    single = PolicyWorker(
        draft_config(path, "fixed"),
        weights_path=f"{root}/weights",
        optimizer_path=f"{root}/optimizer",
        parallel=ParallelContext.single(torch.device("cpu")),
    )
    for name, value in single.state.draft.model.state_dict().items():
        assert torch.equal(value, draft[name]), f"checkpoint: {name}"
    single.shutdown()

"""Properties of batching.plan_microbatches under the spec a config gives (microbatch_spec)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.config import load_config
from policyworker.functional.batching import plan_microbatches
from policyworker.shell.worker.microbatches import microbatch_spec

MODES = st.sampled_from(["fixed", "dynamic", "packed"])


def _config(mode: str, budget: int, logprob_budget: int | None):
    cfg = {"model_name": "unused"}
    if mode == "dynamic":
        cfg["dynamic_batching"] = {
            "enabled": True,
            "train_mb_tokens": budget,
            "logprob_mb_tokens": logprob_budget,
            "sequence_length_round": 1,
        }
    elif mode == "packed":
        cfg["sequence_packing"] = {
            "enabled": True,
            "train_mb_tokens": budget,
            "logprob_mb_tokens": logprob_budget,
        }
    return load_config(cfg)


@settings(deadline=None)
@given(
    MODES,
    st.lists(st.integers(0, 16), min_size=1, max_size=12),
    st.integers(1, 4),
    st.sampled_from(["train", "logprob"]),
    st.integers(16, 40),
    st.one_of(st.none(), st.integers(16, 40)),
)
def test_every_row_is_planned_exactly_once_within_its_budget(
    mode, lengths, mbs, purpose, budget, logprob_budget
):
    cfg = _config(mode, budget, logprob_budget)
    lengths_B = torch.tensor(lengths)
    spec = microbatch_spec(cfg, purpose)
    plans = plan_microbatches(spec, lengths_B, seq_len=16, mbs=mbs)
    rows = sorted(r for p in plans for r in p.rows)
    assert rows == list(range(len(lengths)))
    assert not any(p.is_dummy for p in plans)
    limit = budget if purpose == "train" or logprob_budget is None else logprob_budget
    for p in plans:
        assert p.packed == (mode == "packed")
        if mode == "fixed":
            assert len(p.rows) <= mbs and p.width == 16
        elif mode == "dynamic":
            assert len(p.rows) == 1 or len(p.rows) * p.width <= limit
        else:
            assert sum(lengths[r] for r in p.rows) <= limit

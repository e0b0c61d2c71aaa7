"""Properties of the GRPO run's pure bookkeeping (advantages, data order, keep-top-k, metrics)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.functional.grpo import (
    STEP_METRICS,
    baseline_and_std,
    checkpoints_to_remove,
    grpo_advantages,
    prompt_indices,
    reduce_step_metrics,
    response_length,
    rollout_batch,
    run_summary,
)

rewards_lists = st.integers(1, 5).flatmap(
    lambda g: st.tuples(
        st.just(g),
        st.integers(1, 4).flatmap(
            lambda p: st.lists(st.floats(-10, 10, allow_nan=False), min_size=p * g, max_size=p * g)
        ),
    )
)


def _reference(rewards, g, *, loo, normalize, eps=1e-6):
    """NeMo-RL's loop: a mask matrix over each prompt's rows (eye removed for leave-one-out)."""
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if not (loo and j == i)]
            if not others:
                out.append(0.0)
                continue
            mean = sum(others) / len(others)
            var = max(sum(x * x for x in others) / len(others) - mean * mean, 0.0)
            std = math.sqrt(var)
            adv = r - mean
            out.append(adv / (std + eps) if normalize and std > 0 else adv)
    return out


@settings(max_examples=80, deadline=None)
@given(rewards_lists, st.booleans(), st.booleans())
def test_advantages_match_the_per_prompt_reference(case, loo, normalize):
    g, rewards = case
    got = grpo_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        g,
        normalize_rewards=normalize,
        leave_one_out=loo,
    )
    want = _reference(rewards, g, loo=loo, normalize=normalize)
    assert torch.allclose(
        got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-3
    )


@settings(max_examples=60, deadline=None)
@given(rewards_lists, st.floats(-5, 5), st.booleans())
def test_shifting_all_rewards_leaves_advantages_unchanged(case, shift, loo):
    g, rewards = case
    r = torch.tensor(rewards, dtype=torch.float64)
    a = grpo_advantages(r, g, normalize_rewards=False, leave_one_out=loo)
    b = grpo_advantages(r + shift, g, normalize_rewards=False, leave_one_out=loo)
    assert torch.allclose(a, b, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(rewards_lists)
def test_group_mean_baseline_advantages_sum_to_zero_per_group(case):
    g, rewards = case
    adv = grpo_advantages(torch.tensor(rewards), g, normalize_rewards=False, leave_one_out=False)
    assert torch.allclose(
        adv.double().reshape(-1, g).sum(1),
        torch.zeros(len(rewards) // g, dtype=torch.float64),
        atol=1e-3,
    )


def test_tied_group_is_zero_and_bad_groups_are_refused():
    adv = grpo_advantages(torch.ones(4), 4, normalize_rewards=True, leave_one_out=True)
    assert torch.equal(adv, torch.zeros(4))
    _, std = baseline_and_std(torch.tensor([0.0, 1.0]), 1, leave_one_out=True)
    assert torch.equal(std, torch.zeros(2))
    with pytest.raises(ValueError, match="group_size=3"):
        grpo_advantages(torch.ones(4), 3, normalize_rewards=True, leave_one_out=True)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 7), st.integers(0, 50), st.booleans(), st.integers(1, 6))
def test_each_epoch_reads_every_row_once_and_steps_are_reproducible(
    n, per_step, seed, shuffle, steps
):
    stream = [
        i
        for k in range(1, steps + 1)
        for i in prompt_indices(k, num_items=n, per_step=per_step, seed=seed, shuffle=shuffle)
    ]
    for start in range(0, len(stream) - n + 1, n):
        if start % n == 0 and start + n <= len(stream):
            assert sorted(stream[start : start + n]) == list(range(n))
    again = prompt_indices(steps, num_items=n, per_step=per_step, seed=seed, shuffle=shuffle)
    assert stream[-per_step:] == again
    if not shuffle:
        assert stream == [i % n for i in range(len(stream))]


def test_prompt_indices_refuses_step_zero():
    with pytest.raises(ValueError, match="step=0"):
        prompt_indices(0, num_items=3, per_step=1, seed=0, shuffle=True)


saved_lists = st.lists(
    st.one_of(st.none(), st.floats(-5, 5, allow_nan=False)), min_size=0, max_size=10
).map(lambda ms: [(i + 1, m) for i, m in enumerate(ms)])


@settings(max_examples=100, deadline=None)
@given(saved_lists, st.one_of(st.none(), st.integers(1, 5)), st.booleans())
def test_keep_top_k_keeps_the_best_k_and_the_latest(saved, k, higher):
    gone = checkpoints_to_remove(saved, keep_top_k=k, higher_is_better=higher)
    kept = [s for s in saved if s[0] not in gone]
    if k is None or len(saved) <= k:
        assert gone == []
        return
    assert max(s for s, _ in saved) in {s for s, _ in kept}
    assert k <= len(kept) <= k + 1
    sign = 1 if higher else -1
    scored = [sign * m for _, m in kept if m is not None]
    for step, metric in saved:
        if step in gone and metric is not None and len(scored) >= k:
            assert sum(1 for v in scored if v >= sign * metric) >= k


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=16), st.floats(0.01, 100), st.floats(0, 1))
def test_step_metrics_reduce_rewards_and_rate(rewards, step_s, refit_s):
    r = torch.tensor(rewards)
    lengths = torch.full((len(rewards),), 3)
    m = reduce_step_metrics(
        rewards_N=r,
        response_lengths_N=lengths,
        train_metrics={"loss": 2.0},
        step_s=step_s,
        refit_s=refit_s,
    )
    assert m["reward_min"] <= m["reward_mean"] + 1e-9 and m["reward_mean"] <= m["reward_max"] + 1e-9
    assert math.isclose(m["tokens_per_s"] * step_s, 3 * len(rewards), rel_tol=1e-9)
    assert sorted(m) == sorted(STEP_METRICS)
    assert m["kl"] == 0.0 and m["loss"] == 2.0 and math.isclose(m["refit_ms"], refit_s * 1e3)
    summary = run_summary([m, {**m, "reward_mean": m["reward_mean"] + 1}])
    assert summary["steps"] == 2 and summary["reward_last"] == summary["reward_best"]
    assert math.isclose(summary["total_s"], 2 * step_s)
    assert run_summary([]) == {}
    with pytest.raises(ValueError, match="step_s=0"):
        reduce_step_metrics(
            rewards_N=r, response_lengths_N=lengths, train_metrics={}, step_s=0, refit_s=0
        )


token_rows = st.lists(st.integers(2, 9), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(token_rows, token_rows), min_size=1, max_size=5), st.integers(0, 9))
def test_rollout_batch_round_trips_rows_and_masks_only_responses(rows, eos):
    prompts = [p for p, _ in rows]
    responses = [r[: response_length(r, eos_token_id=eos)] for _, r in rows]
    logprobs = [[-0.5 * (j + 1) for j in range(len(r))] for r in responses]
    adv = torch.arange(len(rows), dtype=torch.float32)
    batch = rollout_batch(prompts, responses, logprobs, adv, pad_token_id=0)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = int(batch["input_lengths"][i])
        assert n == len(p) + len(r)
        assert batch["input_ids"][i, :n].tolist() == [*p, *r]
        assert batch["input_ids"][i, n:].eq(0).all()
        assert (
            batch["token_mask"][i].sum() == len(r) and batch["token_mask"][i, : len(p)].eq(0).all()
        )
        assert batch["generation_logprobs"][i].sum().item() == pytest.approx(sum(logprobs[i]))
        assert batch["advantages"][i].eq(float(i)).all()
    for _, r in rows:
        k = response_length(r, eos_token_id=eos)
        assert eos not in r[: k - 1] and (k == len(r) or r[k - 1] == eos)
    with pytest.raises(ValueError, match="one of each"):
        rollout_batch(
            prompts, responses[:-1] if len(rows) > 1 else [], logprobs, adv, pad_token_id=0
        )

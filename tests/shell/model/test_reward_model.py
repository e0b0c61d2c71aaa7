"""Reward models: a causal-LM folder (untrained score head) is named at start-up, and a
Bradley-Terry reward model trains with `train(data, PreferenceLoss())` on a tiny model."""

from __future__ import annotations

import logging

import torch

from policyworker.functional.reward_loss import PreferenceLoss
from policyworker.shell.model import sources
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import VOCAB, make_config

RM = {"reward_model_cfg": {"enabled": True, "reward_model_type": "bradley_terry"}}


def test_a_causal_lm_folder_as_reward_model_warns_once_naming_it(tiny_model_paths, caplog):
    path = tiny_model_paths["qwen2"]
    sources._WARNED_HEADS.discard(path)
    with caplog.at_level(logging.WARNING, logger="policyworker"):
        for _ in range(2):
            PolicyWorker(make_config(path, **RM), init_optimizer=False, init_reference_model=False)
    warned = [r.getMessage() for r in caplog.records if "no trained score head" in r.getMessage()]
    assert len(warned) == 1 and repr(path) in warned[0] and "score.weight" in warned[0]


def test_a_trained_reward_model_folder_does_not_warn(tiny_reward_paths, caplog):
    with caplog.at_level(logging.WARNING, logger="policyworker"):
        PolicyWorker(
            make_config(tiny_reward_paths["bradley_terry"], **RM),
            init_optimizer=False,
            init_reference_model=False,
        )
    assert not [r for r in caplog.records if "no trained score head" in r.getMessage()]


def _pairs(num_pairs: int, seed: int) -> dict:
    """Interleaved (chosen, rejected) rows: same random prompt, the chosen ends in token 5 and
    the rejected in token 7, at different lengths."""
    g = torch.Generator().manual_seed(seed)
    width = 8
    ids = torch.zeros(2 * num_pairs, width, dtype=torch.int64)
    lengths = torch.randint(3, width + 1, (2 * num_pairs,), generator=g)
    for i in range(num_pairs):
        prompt = torch.randint(8, VOCAB, (width,), generator=g)
        for row, last in ((2 * i, 5), (2 * i + 1, 7)):
            n = int(lengths[row])
            ids[row, :n] = prompt[:n]
            ids[row, n - 1] = last
    return {"input_ids": ids, "input_lengths": lengths, "sample_mask": torch.ones(2 * num_pairs)}


def test_a_bradley_terry_reward_model_learns_a_preference_with_train(tiny_reward_paths):
    worker = PolicyWorker(
        make_config(tiny_reward_paths["bradley_terry"], **RM), init_reference_model=False
    )
    held_out = _pairs(8, seed=99)
    before = worker.score(held_out)["scores"]
    first = worker.train(_pairs(4, seed=0), PreferenceLoss())
    for step in range(1, 12):
        last = worker.train(_pairs(4, seed=step), PreferenceLoss())
    after = worker.score(held_out)["scores"]
    assert set(first["all_mb_metrics"]) >= {"accuracy", "rewards_chosen_mean", "loss"}
    assert float(last["global_loss"].mean()) < 0.5 * float(first["global_loss"][0])  # ln 2 at start
    assert bool((after[0::2] > after[1::2]).all()), (before, after)


def test_the_training_example_of_docs_reward_models_runs(tiny_model_paths, tmp_path):
    """The how-to's python block, with the tiny model, a temp folder and a batch filled in."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "reward-models.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", doc, re.S)
    code = code.replace("/models/llama-1b", tiny_model_paths["llama"])
    code = code.replace("/runs/rm/step-100", str(tmp_path / "rm"))
    batch = _pairs(4, seed=0)
    namespace = {"input_ids": batch["input_ids"], "input_lengths": batch["input_lengths"]}
    exec(compile(code, "docs/reward-models.md", "exec"), namespace)  # noqa: S102 -- our own doc
    assert (tmp_path / "rm" / "model" / "config.json").is_file()
    saved = PolicyWorker(
        make_config(str(tmp_path / "rm" / "model"), **RM),
        init_optimizer=False,
        init_reference_model=False,
    )
    assert saved.score(batch)["scores"].shape == (8,)

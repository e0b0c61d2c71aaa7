"""Draft co-training (policy.draft) on a tiny Llama policy with a one-layer Eagle3-style draft.

The draft's top-1 agreement with the policy rises while the policy trains; the policy's own
training is bit-identical with and without the draft (the draft reads detached activations);
`draft.<name>` tensors follow the policy's in the refit metadata and stream; the draft's weights
and optimizer state survive a checkpoint round trip (and `draft.model_name` loads a saved
draft); bad settings raise errors naming the key.
"""

from __future__ import annotations

import math

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.checkpoint import CheckpointError
from policyworker.shell.refit.weight_stream import DRAFT_PREFIX, params_generator
from policyworker.shell.worker import offload
from policyworker.shell.worker.draft import default_aux_layers
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import VOCAB, make_config


def _affine_batch(rows: int, seed: int, seq_len: int = 16) -> dict:
    """Sequences of a fixed affine rule (next = 5 * id + 7 mod 125, + 3): learnable in steps."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(rows, seq_len, dtype=torch.int64)
    ids[:, 0] = torch.randint(3, VOCAB, (rows,), generator=gen)
    for t in range(1, seq_len):
        ids[:, t] = (ids[:, t - 1] * 5 + 7) % (VOCAB - 3) + 3
    return {
        "input_ids": ids,
        "input_lengths": torch.full((rows,), seq_len),
        "token_mask": torch.ones(rows, seq_len),
        "sample_mask": torch.ones(rows),
    }


def _worker(path, **overrides):
    return PolicyWorker(make_config(path, train_global_batch_size=8, **overrides))


def _agreement(worker, data) -> float:
    """The draft's top-1 agreement with the policy's next-token choice on `data` (no step)."""
    metrics = worker.train(data, NLLLoss(), eval_mode=True)["all_mb_metrics"]
    return sum(metrics["draft_top1_agreement"])


def test_default_aux_layers_are_early_middle_late_and_exist():
    assert default_aux_layers(32) == (1, 15, 28)
    assert default_aux_layers(2) == (0, 1)
    assert default_aux_layers(1) == (0,)


def test_draft_agreement_with_the_policy_rises_while_training(tiny_model_paths):
    torch.manual_seed(0)  # the fresh draft's initialization
    worker = _worker(tiny_model_paths["llama"], draft={"loss_weight": 1.0})
    held_out = _affine_batch(8, seed=999)
    curve = [_agreement(worker, held_out)]
    for step in range(8):
        worker.train(_affine_batch(8, seed=step), NLLLoss())
        if step % 4 == 3:
            curve.append(_agreement(worker, held_out))
    print("draft top-1 agreement:", [round(a, 3) for a in curve])
    assert curve[0] < 0.5 and curve[-1] > 0.8 and curve[-1] > curve[0] + 0.4, curve


def test_the_policy_trains_bit_identically_with_and_without_a_draft(tiny_model_paths):
    plain = _worker(tiny_model_paths["llama"])
    drafted = _worker(tiny_model_paths["llama"], draft={"num_layers": 2})
    for step in range(2):
        data = _affine_batch(8, seed=step)
        want, got = plain.train(data, NLLLoss()), drafted.train(data, NLLLoss())
        assert torch.equal(got["global_loss"], want["global_loss"])
        assert "draft_loss" in got["all_mb_metrics"] and "draft_loss" not in want["all_mb_metrics"]
    policy = dict(plain.model.named_parameters())
    assert all(torch.equal(p, policy[n]) for n, p in drafted.model.named_parameters())
    assert len(drafted.state.draft.model.layers) == 2


def test_draft_tensors_follow_the_policys_in_the_refit_stream(tiny_model_paths):
    worker = _worker(tiny_model_paths["llama"], draft={}, precision="bfloat16")
    worker.train(_affine_batch(8, seed=0), NLLLoss())
    info = list(worker.prepare_refit_info().items())
    names = [n for n, _ in info]
    first_draft = next(i for i, n in enumerate(names) if n.startswith(DRAFT_PREFIX))
    assert all(n.startswith(DRAFT_PREFIX) for n in names[first_draft:])
    assert first_draft == len(list(params_generator(worker.model, torch.bfloat16)))
    draft_state = worker.state.draft.model.state_dict()
    assert sorted(n[len(DRAFT_PREFIX) :] for n in names[first_draft:]) == sorted(draft_state)
    streamed = dict(params_generator(worker.model, torch.bfloat16, worker.state.draft.model))
    for name, tensor in draft_state.items():
        assert torch.equal(streamed[DRAFT_PREFIX + name], tensor.to(torch.bfloat16))


def test_draft_weights_and_optimizer_survive_a_checkpoint(tiny_model_paths, tmp_path):
    path = tiny_model_paths["llama"]
    cfg = make_config(path, train_global_batch_size=8, draft={"loss_weight": 0.5})
    worker = PolicyWorker(cfg)
    for step in range(2):
        worker.train(_affine_batch(8, seed=step), NLLLoss())
    worker.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))
    worker.finalize_async_save()
    saved = {k: v.clone() for k, v in worker.state.draft.model.state_dict().items()}
    restored = PolicyWorker(
        cfg, weights_path=str(tmp_path / "w"), optimizer_path=str(tmp_path / "o")
    )
    assert all(torch.equal(v, saved[k]) for k, v in restored.state.draft.model.state_dict().items())
    data = _affine_batch(8, seed=5)
    worker.train(data, NLLLoss())
    restored.train(data, NLLLoss())  # the same optimizer state -> the same next step
    trained = worker.state.draft.model.state_dict()
    assert not torch.equal(trained["fc.weight"], saved["fc.weight"])
    assert all(
        torch.equal(v, trained[k]) for k, v in restored.state.draft.model.state_dict().items()
    )

    named = PolicyWorker(
        make_config(
            path, train_global_batch_size=8, draft={"model_name": str(tmp_path / "w" / "draft")}
        )
    )
    assert all(torch.equal(v, saved[k]) for k, v in named.state.draft.model.state_dict().items())

    plain = PolicyWorker(make_config(path, train_global_batch_size=8))
    plain.save_checkpoint(str(tmp_path / "plain"))
    plain.finalize_async_save()
    with pytest.raises(ValueError, match="has no draft/model.safetensors"):
        PolicyWorker(cfg, weights_path=str(tmp_path / "plain"))
    policy = {k: v.clone() for k, v in worker.model.state_dict().items()}
    with pytest.raises(ValueError, match="has no draft/model.safetensors"):
        worker.load_checkpoint(str(tmp_path / "plain"))
    assert all(torch.equal(v, policy[k]) for k, v in worker.model.state_dict().items())
    weights = tmp_path / "w" / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        worker.load_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))
    assert all(torch.equal(v, policy[k]) for k, v in worker.model.state_dict().items())


def _draft_step(worker, data) -> tuple[float, dict[str, torch.Tensor]]:
    """One training step: (the global batch's draft loss, the draft's gradients before its step)."""
    grads: dict[str, torch.Tensor] = {}
    draft = worker.state.draft
    finish = draft.finish_step

    def keep_grads(*, applied: bool) -> None:
        grads.update({n: p.grad.clone() for n, p in draft.model.named_parameters()})
        finish(applied=applied)

    draft.finish_step = keep_grads
    try:
        metrics = worker.train(data, NLLLoss())["all_mb_metrics"]
    finally:
        del draft.finish_step
    return sum(metrics["draft_loss"]), grads


# Packing changes only the order of fp32 sums (attention over a packed row, the loss's
# per-microbatch partial sums): parity is checked at fp32 accumulation noise.
PACKED_TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_packed_draft_training_matches_unpacked(tiny_model_paths):
    """Under sequence packing the draft sees each document alone (no input or target crosses a
    document boundary): its loss and gradients match unpacked training."""
    lengths = [16, 5, 11, 3, 16, 9, 2, 13]
    data = {**_affine_batch(8, seed=3), "input_lengths": torch.tensor(lengths)}
    data["token_mask"] = (torch.arange(16)[None] < data["input_lengths"][:, None]).float()
    results = {}
    for name, extra in {
        "unpacked": {},
        "packed": {"sequence_packing": {"train_mb_tokens": 24}},
    }.items():
        torch.manual_seed(0)  # the same fresh draft in both workers
        worker = _worker(
            tiny_model_paths["llama"],
            draft={"loss_weight": 1.0},
            optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}},  # no Adam sign-flips
            **extra,
        )
        results[name] = [_draft_step(worker, data) for _ in range(2)]
    for (want_loss, want_grads), (got_loss, got_grads) in zip(
        results["unpacked"], results["packed"], strict=True
    ):
        assert want_grads.keys() == got_grads.keys() and want_grads
        worst = max(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items())
        print(f"packed - unpacked: draft loss {got_loss - want_loss:.2e}, grads max {worst:.2e}")
        assert math.isclose(got_loss, want_loss, rel_tol=1e-5), (got_loss, want_loss)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, **PACKED_TOL, msg=name)


def test_the_draft_is_saved_by_the_policys_async_save(tiny_model_paths, tmp_path):
    """The draft's folders are staged with the policy's and committed by finalize_async_save
    (never visible before it); the saved draft is the one at save time, though training went on
    before the writes were finalized."""
    worker = _worker(tiny_model_paths["llama"], draft={})
    worker.train(_affine_batch(8, seed=0), NLLLoss())
    at_save = {k: v.clone() for k, v in worker.state.draft.model.state_dict().items()}
    opt_at_save = {k: v.clone() for k, v in worker.state.draft.optimizer.state[0].items()}
    worker.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))
    assert not (tmp_path / "w" / "draft").exists() and not (tmp_path / "o" / "draft").exists()
    worker.train(_affine_batch(8, seed=1), NLLLoss())  # changes the live draft in place
    worker.finalize_async_save()
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["draft", "model", "reference"]
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["draft", "optim"]
    restored = PolicyWorker(
        worker.state.cfg, weights_path=str(tmp_path / "w"), optimizer_path=str(tmp_path / "o")
    )
    draft = restored.state.draft
    assert all(torch.equal(v, at_save[k]) for k, v in draft.model.state_dict().items())
    assert all(torch.equal(v, opt_at_save[k]) for k, v in draft.optimizer.state[0].items())


def test_the_draft_and_its_optimizer_follow_the_policy_through_offload(
    tiny_model_paths, monkeypatch
):
    """Every offload step moves the draft (and its optimizer state) where it moves the policy
    (and its optimizer state). On a CPU box both places are the CPU: the test records the moves
    (tests/gpu checks the memory)."""
    worker = _worker(tiny_model_paths["llama"], draft={})
    data = _affine_batch(8, seed=0)
    worker.train(data, NLLLoss())
    draft = worker.state.draft
    moves: list[tuple[str, str]] = []
    names = {id(worker.model): "policy", id(draft.model): "draft"}
    opt_names = {id(worker.optimizer): "policy", id(draft.optimizer): "draft"}
    move_model, move_state = offload.move_model, offload._move_optimizer_state

    def record_model(state, model, device):
        moves.append((names.get(id(model), "other"), str(state.resolve_device(device))))
        return move_model(state, model, device)

    def record_optimizer(optimizer, device):
        moves.append((f"{opt_names[id(optimizer)]} optimizer", str(device)))
        move_state(optimizer, device)

    monkeypatch.setattr(offload, "move_model", record_model)
    monkeypatch.setattr(offload, "_move_optimizer_state", record_optimizer)
    here = str(worker.device)
    steps = {
        worker.offload_before_refit: {("policy optimizer", "cpu"), ("draft optimizer", "cpu")},
        worker.offload_after_refit: {
            ("policy", "cpu"),
            ("draft", "cpu"),
            ("policy optimizer", "cpu"),
            ("draft optimizer", "cpu"),
        },
        worker.prepare_for_training: {
            ("policy", here),
            ("draft", here),
            ("policy optimizer", here),
            ("draft optimizer", here),
        },
        worker.finish_inference: {("policy", "cpu"), ("draft", "cpu")},
    }
    for step, want in steps.items():
        moves.clear()
        step()
        assert set(moves) == want, (step.__name__, moves)
    worker.prepare_for_training()
    assert worker.train(data, NLLLoss())["skipped_steps"] == 0


def test_bad_draft_settings_raise_naming_the_key(tiny_model_paths, tiny_reward_paths):
    with pytest.raises(ValueError, match="policy.draft needs a causal LM"):
        PolicyWorker(
            make_config(
                tiny_reward_paths["regression"],
                draft={},
                reward_model_cfg={"reward_model_type": "regression"},
            )
        )
    with pytest.raises(ValueError, match="aux_layer_indices"):
        _worker(tiny_model_paths["llama"], draft={"aux_layer_indices": [0, 5]})

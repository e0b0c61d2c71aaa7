"""MoE routers through the worker, on tiny real Qwen3-MoE, Mixtral and DeepSeek-V3 models.

Gate-bias update: the step's expert loads (every microbatch, real tokens only) equal an
independent count; the bias moves by exactly rate * sign(mean - load), stays fp32 through bf16
training, a checkpoint round trip and the refit stream; rate 0 leaves it bit-identical; routers
without a bias are skipped with one warning. Router replay: replaying the model's own routes gives
bitwise the same logprobs and losses (fixed and packed batching); a different route at some
tokens of the last MoE layer changes exactly the logprobs those tokens feed; the reference model
ignores routes; bad or missing routes raise ValueError naming `routed_experts`.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from policyworker.functional.loss import NLLLoss
from policyworker.functional.moe import MISSING_ROUTE
from policyworker.shell.refit.weight_stream import params_generator
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.helpers import (
    own_moe_routes,
    tiny_deepseek_v3_config,
    tiny_mixtral_config,
    tiny_qwen3_moe_config,
)
from tests.shell.conftest import make_batch, make_config

MODEL_TYPES = ("deepseek_v3", "qwen3_moe", "mixtral")
_CONFIGS = {
    "deepseek_v3": tiny_deepseek_v3_config,
    "qwen3_moe": tiny_qwen3_moe_config,
    "mixtral": tiny_mixtral_config,
}
LENGTHS = (12, 9, 5, 12)
RATE = 0.01


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_moe")
    paths = {}
    for seed, model_type in enumerate(MODEL_TYPES):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_CONFIGS[model_type]())
        with torch.no_grad():  # decisive routers: gate logits well apart
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
        model.save_pretrained(root / model_type)
        paths[model_type] = str(root / model_type)
    return paths


def _batch():
    return make_batch(4, 12, seed=3, lengths=LENGTHS)


def _worker(path, **overrides):
    return PolicyWorker(make_config(path, **overrides))


def _own_routes(worker, data) -> torch.Tensor:
    return own_moe_routes(worker.model, worker.state.moe.routers, data)


def _load_by_count(worker, data) -> torch.Tensor:
    """Independent count of every biased router's expert loads over the real tokens."""
    routes = _own_routes(worker, data)
    biased = [i for i, r in enumerate(worker.state.moe.routers) if r.bias is not None]
    valid = torch.arange(routes.shape[1])[None] < data["input_lengths"][:, None]
    return torch.stack(
        [
            torch.bincount(
                routes[:, :, i][valid].reshape(-1),
                minlength=worker.state.moe.routers[i].num_experts,
            )
            for i in biased
        ]
    )


def _bias(worker):
    return {r.name: r.bias.detach().clone() for r in worker.state.moe.routers if r.bias is not None}


# ---------------------------------------------------------------------------- gate-bias update


@pytest.mark.parametrize(
    "batching", [{}, {"sequence_packing": {"train_mb_tokens": 24}}], ids=["fixed", "packed"]
)
def test_bias_moves_by_rate_times_sign_of_the_whole_steps_load(moe_paths, batching):
    worker = _worker(
        moe_paths["deepseek_v3"],
        train_micro_batch_size=1,
        dtensor_cfg={"moe_router_bias_update_rate": RATE},
        **batching,
    )
    data = _batch()
    want_load = _load_by_count(worker, data)
    before = _bias(worker)
    worker.train(data, NLLLoss())
    ((name, load),) = worker.state.moe.last_step_load.items()
    assert torch.equal(load, want_load[0]) and int(load.sum()) == sum(LENGTHS) * 2
    mean = load.double().mean()
    step = torch.where(load > mean, -RATE, torch.where(load < mean, RATE, 0.0)).float()
    after = _bias(worker)[name]
    assert after.dtype == torch.float32
    assert torch.equal(after, before[name] + step)


def test_the_update_lands_on_the_live_buffer_after_the_model_moved(moe_paths):
    worker = _worker(moe_paths["deepseek_v3"], dtensor_cfg={"moe_router_bias_update_rate": RATE})
    gate = worker.state.moe.routers[0].module
    gate.e_score_correction_bias = gate.e_score_correction_bias.clone()  # as .to(device) does
    before = gate.e_score_correction_bias.clone()
    worker.train(_batch(), NLLLoss())
    assert not torch.equal(gate.e_score_correction_bias, before)


def test_rate_zero_leaves_the_bias_bit_identical(moe_paths):
    worker = _worker(moe_paths["deepseek_v3"])
    before = _bias(worker)
    worker.train(_batch(), NLLLoss())
    assert worker.state.moe.routers[0].module._forward_hooks == {}  # nothing hooked when off
    assert all(torch.equal(before[k], v) for k, v in _bias(worker).items())


def test_eval_mode_and_logprobs_do_not_move_the_bias(moe_paths):
    worker = _worker(moe_paths["deepseek_v3"], dtensor_cfg={"moe_router_bias_update_rate": RATE})
    before = _bias(worker)
    worker.train(_batch(), NLLLoss(), eval_mode=True)
    worker.get_logprobs(_batch())
    assert all(torch.equal(before[k], v) for k, v in _bias(worker).items())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_routers_without_a_bias_are_skipped_with_one_warning(moe_paths, model_type, caplog):
    with caplog.at_level(logging.WARNING, logger="policyworker.shell.model.moe"):
        worker = _worker(moe_paths[model_type], dtensor_cfg={"moe_router_bias_update_rate": RATE})
        worker.train(_batch(), NLLLoss())
        worker.train(_batch(), NLLLoss())
    notes = [r.getMessage() for r in caplog.records if "moe_router_bias_update_rate" in r.message]
    assert len(notes) == 1 and model_type in notes[0] and "e_score_correction_bias" in notes[0]


def _cv(load: torch.Tensor) -> float:
    """Coefficient of variation of expert loads (0 = perfectly balanced)."""
    load = load.double()
    return float(load.std(unbiased=False) / load.mean())


def test_bias_balances_a_skewed_router_and_stays_fp32_through_checkpoint_and_refit(tmp_path):
    cfg = tiny_deepseek_v3_config()
    cfg.n_routed_experts, cfg.n_group, cfg.topk_group = 8, 1, 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "ds8")
    path = str(tmp_path / "ds8")
    worker = _worker(
        path,
        precision="bfloat16",
        train_global_batch_size=8,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4}},
        dtensor_cfg={"moe_router_bias_update_rate": 0.02},
    )
    (router,) = worker.state.moe.routers
    with torch.no_grad():  # experts 0 and 1 preferred; the update must undo the skew
        router.bias.copy_(torch.tensor([0.3, 0.3, 0, 0, 0, 0, 0, 0]))
    held_out = make_batch(16, 12, seed=99)
    cv_before = _cv(_load_by_count(worker, held_out)[0])
    for step in range(12):
        worker.train(make_batch(8, 12, seed=step % 4), NLLLoss())
    cv_after = _cv(_load_by_count(worker, held_out)[0])
    assert cv_after < 0.7 * cv_before, (cv_before, cv_after)
    assert router.bias.dtype == torch.float32 and float(router.bias[:2].max()) < 0.3

    trained = _bias(worker)
    worker.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optimizer"))
    worker.finalize_async_save()
    restored = PolicyWorker(
        make_config(path, precision="bfloat16"),
        weights_path=str(tmp_path / "weights"),
        optimizer_path=str(tmp_path / "optimizer"),
    )
    for name, bias in _bias(restored).items():
        assert bias.dtype == torch.float32 and torch.equal(bias, trained[name])

    info = worker.prepare_refit_info()
    streamed = dict(params_generator(worker.model, torch.bfloat16))
    bias_names = [n for n in info if n.endswith("e_score_correction_bias")]
    assert bias_names == [router.name + ".e_score_correction_bias"]
    assert info[bias_names[0]][1] == torch.float32
    assert torch.equal(streamed[bias_names[0]], trained[router.name])
    assert info["model.embed_tokens.weight"][1] == torch.bfloat16


# ---------------------------------------------------------------------------- router replay


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_router_rule_reproduces_its_routers_weights_bitwise(moe_paths, model_type):
    from policyworker.functional.moe import gate_weights_at

    worker = _worker(moe_paths[model_type], router_replay={})
    hidden = torch.randn(
        40, worker.model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    for router in worker.state.moe.routers:
        for dtype in (torch.float32, torch.bfloat16):
            with (
                torch.no_grad(),
                torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32),
            ):
                logits, weights, experts = router.module(hidden)
                again = gate_weights_at(logits, experts, worker.state.moe.rule)
            assert again.dtype == weights.dtype and torch.equal(again, weights)


@pytest.mark.parametrize(
    "batching",
    [
        {},
        {"sequence_packing": {"train_mb_tokens": 24}},
        {"dynamic_batching": {"train_mb_tokens": 24, "sequence_length_round": 4}},
    ],
    ids=["fixed", "packed", "dynamic"],
)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_replaying_the_models_own_routes_is_bitwise_neutral(moe_paths, model_type, batching):
    data = _batch()
    plain = _worker(moe_paths[model_type], **batching)
    replay = _worker(moe_paths[model_type], router_replay={}, **batching)
    data_r = dict(data, routed_experts=_own_routes(replay, data))
    want_lp = plain.get_logprobs(data)["logprobs"]
    assert torch.equal(replay.get_logprobs(data_r)["logprobs"], want_lp)
    got, want = replay.train(data_r, NLLLoss()), plain.train(data, NLLLoss())
    assert torch.equal(got["global_loss"], want["global_loss"])
    assert got["grad_norm"] == want["grad_norm"]
    data_r = dict(data, routed_experts=_own_routes(replay, data))  # the trained model's routes
    want_lp = plain.get_logprobs(data)["logprobs"]
    assert torch.equal(replay.get_logprobs(data_r)["logprobs"], want_lp)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_different_route_changes_exactly_the_logprobs_its_tokens_feed(moe_paths, model_type):
    worker = _worker(moe_paths[model_type], router_replay={})
    data = _batch()
    own = _own_routes(worker, data)
    num_experts = worker.state.moe.routers[-1].num_experts
    altered = own.clone()
    changed = [(0, 2), (0, 7), (1, 4), (2, 0), (3, 10)]  # (row, token), all before the last token
    for b, t in changed:  # the last MoE layer only: no later attention spreads the change
        unused = [e for e in range(num_experts) if e not in own[b, t, -1].tolist()]
        altered[b, t, -1] = torch.tensor(unused[: own.shape[-1]])
    base = worker.get_logprobs(dict(data, routed_experts=own))["logprobs"]
    moved = worker.get_logprobs(dict(data, routed_experts=altered))["logprobs"]
    differs = {tuple(ix) for ix in (moved != base).nonzero().tolist()}
    assert differs == {(b, t + 1) for b, t in changed}
    reference = worker.get_reference_policy_logprobs(dict(data, routed_experts=altered))
    assert torch.equal(reference["reference_logprobs"], base)  # the reference ignores routes
    loss_own = worker.train(dict(data, routed_experts=own), NLLLoss(), eval_mode=True)
    loss_moved = worker.train(dict(data, routed_experts=altered), NLLLoss(), eval_mode=True)
    assert not torch.equal(loss_own["global_loss"], loss_moved["global_loss"])


def test_missing_routes_fall_back_to_the_models_own_router(moe_paths):
    worker = _worker(moe_paths["qwen3_moe"], router_replay={})
    data = _batch()
    own = _own_routes(worker, data)
    unrecorded = torch.full_like(own, MISSING_ROUTE)
    assert torch.equal(
        worker.get_logprobs(dict(data, routed_experts=unrecorded))["logprobs"],
        worker.get_logprobs(dict(data, routed_experts=own))["logprobs"],
    )


def _bad_routes(kind, good):
    if kind == "ndim":
        return good[..., 0]
    if kind == "seq":
        return good[:, :-1]
    if kind == "top_k":
        return good[..., :1]
    if kind == "layers":
        return torch.cat([good, good, good], dim=2)
    if kind == "range":
        return good.masked_fill(good == 0, 99)
    if kind == "partial":
        bad = good.clone()
        bad[0, 0, 0, 0] = MISSING_ROUTE
        bad[0, 0, 0, 1] = 1
        return bad
    if kind == "duplicate":
        bad = good.clone()
        bad[1, 1, 0] = 2
        return bad
    if kind == "float":
        return good.float()
    return good.tolist()


@pytest.mark.parametrize(
    "kind", ["ndim", "seq", "top_k", "layers", "range", "partial", "duplicate", "float", "list"]
)
def test_bad_routes_raise_a_value_error_naming_the_key(moe_paths, kind):
    worker = _worker(moe_paths["mixtral"], router_replay={})
    data = _batch()
    good = _own_routes(worker, data)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    for call in (lambda d: worker.get_logprobs(d), lambda d: worker.train(d, NLLLoss())):
        with pytest.raises(ValueError, match="routed_experts"):
            call(dict(data, routed_experts=_bad_routes(kind, good)))
    assert all(torch.equal(p, before[n]) for n, p in worker.model.named_parameters())


def test_missing_routes_raise_unless_replay_is_not_required(moe_paths):
    worker = _worker(moe_paths["deepseek_v3"], router_replay={})
    data = _batch()
    with pytest.raises(ValueError, match="routed_experts"):
        worker.get_logprobs(data)
    with pytest.raises(ValueError, match="routed_experts"):
        worker.train(data, NLLLoss())
    assert worker.get_logprobs(data, require_router_replay=False)["logprobs"].shape == (4, 12)


def test_full_layer_layout_is_accepted(moe_paths):
    """vLLM lists every decoder layer; DeepSeek-V3's dense layer 0 has no router to replay."""
    worker = _worker(moe_paths["deepseek_v3"], router_replay={})
    data = _batch()
    own = _own_routes(worker, data)  # [B, S, 1, K]: the one MoE layer
    full = torch.cat([torch.full_like(own, MISSING_ROUTE), own], dim=2)
    assert torch.equal(
        worker.get_logprobs(dict(data, routed_experts=full))["logprobs"],
        worker.get_logprobs(dict(data, routed_experts=own))["logprobs"],
    )


def test_router_replay_on_a_dense_model_is_refused_at_construction(tiny_model_paths):
    with pytest.raises(ValueError, match="router_replay.*'llama'"):
        PolicyWorker(make_config(tiny_model_paths["llama"], router_replay={}))

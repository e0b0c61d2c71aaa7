"""MoE routing and draft co-training figures on tiny CPU models (seconds; no download).

1. Gate-bias balance: a tiny DeepSeek-V3 (8 routed experts, top-2, one group) whose router bias
   starts skewed toward experts 0 and 1; the coefficient of variation and max/mean of expert
   load on a held-out batch, before and after N training steps, with
   `moe_router_bias_update_rate` on and (control) off.
2. Router replay parity: for tiny Qwen3-MoE, Mixtral and DeepSeek-V3, the largest logprob change
   when replaying the model's own routes (fixed and packed batching), and, after changing the
   last MoE layer's route at K tokens, how many logprobs changed (K expected).
3. Draft agreement: a tiny Llama policy trained on an affine token rule with a one-layer
   Eagle3-style draft; the draft's top-1 agreement with the policy on a held-out batch.

    python -m bench.moe [--steps 20] [--json bench_moe.json]
"""

import argparse
import json
import pathlib
import tempfile

import torch

from bench.rows import row, write_result
from policyworker import NLLLoss, PolicyWorker
from policyworker.testing import tiny_model_folder

VOCAB = 128
ADAMW = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4}}


def _config(path, **overrides):
    return {
        "model_name": str(path),
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 4,
        "optimizer": ADAMW,
        **overrides,
    }


def _random_batch(rows, seed, seq_len=12):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (rows,), generator=gen)
    ids = torch.randint(3, VOCAB, (rows, seq_len), generator=gen)
    valid = torch.arange(seq_len)[None] < lengths[:, None]
    return {
        "input_ids": torch.where(valid, ids, 0),
        "input_lengths": lengths,
        "token_mask": valid.float(),
        "sample_mask": torch.ones(rows),
    }


def _affine_batch(rows, seed, seq_len=16):
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


def _tiny_moe(model_type, folder):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    shape = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if model_type == "deepseek_v3":
        cfg = DeepseekV3Config(
            **shape,
            intermediate_size=64,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    elif model_type == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **shape,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
        )
    else:
        cfg = MixtralConfig(
            **shape, intermediate_size=16, num_key_value_heads=2, num_local_experts=4
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return str(folder)


def _routes(worker, data):
    """[B, S, MoE layers, K] of the worker's model on `data` (-1 at padding)."""
    seen = []
    hooks = [
        r.module.register_forward_hook(lambda _m, _a, out: seen.append(out[2].clone()))
        for r in worker.state.moe.routers
    ]
    with torch.no_grad():
        worker.model(input_ids=data["input_ids"])
    for h in hooks:
        h.remove()
    ids = data["input_ids"]
    routes = torch.stack([s.reshape(*ids.shape, -1) for s in seen], dim=2)
    valid = torch.arange(ids.shape[1])[None] < data["input_lengths"][:, None]
    return torch.where(valid[..., None, None], routes, -1)


def _load_stats(worker, data):
    routes = _routes(worker, data)[..., 0, :]
    valid = routes[..., 0] >= 0
    load = torch.bincount(routes[valid].reshape(-1), minlength=8).double()
    return {
        "cv": float(load.std(unbiased=False) / load.mean()),
        "max_over_mean": float(load.max() / load.mean()),
        "load": load.int().tolist(),
    }


def balance(root, steps):
    path = _tiny_moe("deepseek_v3", root / "ds8")
    held_out = _random_batch(16, seed=99)
    out = {}
    for rate in (0.02, 0.0):
        worker = PolicyWorker(_config(path, dtensor_cfg={"moe_router_bias_update_rate": rate}))
        with torch.no_grad():
            worker.state.moe.routers[0].module.e_score_correction_bias.copy_(
                torch.tensor([0.3, 0.3, 0, 0, 0, 0, 0, 0])
            )
        before = _load_stats(worker, held_out)
        for step in range(steps):
            worker.train(_random_batch(8, seed=step % 4), NLLLoss())
        out[f"rate={rate}"] = {"before": before, "after": _load_stats(worker, held_out)}
    return out


def replay(root):
    out = {}
    data = _random_batch(4, seed=3)
    for model_type in ("qwen3_moe", "mixtral", "deepseek_v3"):
        path = _tiny_moe(model_type, root / model_type)
        for batching, extra in (
            ("fixed", {}),
            ("packed", {"sequence_packing": {"train_mb_tokens": 24}}),
        ):
            plain = PolicyWorker(_config(path, **extra))
            worker = PolicyWorker(_config(path, router_replay={}, **extra))
            own = _routes(worker, data)
            base = plain.get_logprobs(data)["logprobs"]
            replayed = worker.get_logprobs(dict(data, routed_experts=own))["logprobs"]
            altered = own.clone()
            tokens = [(0, 1), (1, 3), (2, 2)]
            for b, t in tokens:
                used = own[b, t, -1].tolist()
                free = [e for e in range(worker.state.moe.routers[-1].num_experts) if e not in used]
                altered[b, t, -1] = torch.tensor(free[: len(used)])
            moved = worker.get_logprobs(dict(data, routed_experts=altered))["logprobs"]
            out[f"{model_type}/{batching}"] = {
                "own_routes_max_abs_diff": float((replayed - base).abs().max()),
                "altered_tokens": len(tokens),
                "changed_logprobs": int((moved != replayed).sum()),
            }
    return out


def draft(root, steps):
    tiny_model_folder(root / "llama", "llama", vocab=VOCAB, seed=0)
    worker = PolicyWorker(
        _config(
            root / "llama",
            draft={"loss_weight": 1.0},
            optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
        )
    )
    held_out = _affine_batch(8, seed=999)

    def agreement():
        m = worker.train(held_out, NLLLoss(), eval_mode=True)["all_mb_metrics"]
        return round(sum(m["draft_top1_agreement"]), 3)

    curve = [(0, agreement())]
    for step in range(1, steps + 1):
        worker.train(_affine_batch(8, seed=step), NLLLoss())
        if step in (1, 2, 4, 8) or step % 10 == 0:
            curve.append((step, agreement()))
    return curve


def summary_rows(report: dict, steps: int) -> list[dict]:
    """The row schema: balance with the bias update against the control without it, replay's
    logprob change against zero, the draft's agreement against its untrained start."""
    on, off = report["balance"]["rate=0.02"]["after"], report["balance"]["rate=0.0"]["after"]
    rows = [
        row(
            f"expert load CV after {steps} steps, router bias update on (rate 0.02)",
            on["cv"],
            baseline=off["cv"],
            baseline_name="the same steps with the update off",
        )
    ]
    for key, r in report["replay"].items():
        rows += [
            row(
                f"{key}: max |logprob change| replaying the model's own routes",
                r["own_routes_max_abs_diff"],
                unit="nats",
                limit=0.0,
            ),
            row(
                f"{key}: logprobs changed by re-routing {r['altered_tokens']} tokens",
                r["changed_logprobs"],
                baseline=r["altered_tokens"],
                baseline_name="tokens re-routed (one logprob each expected)",
            ),
        ]
    curve = report["draft_agreement"]
    rows.append(
        row(
            f"draft top-1 agreement after {curve[-1][0]} steps",
            curve[-1][1],
            baseline=curve[0][1],
            baseline_name="the untrained draft",
            limit=1.0,
        )
    )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="accepted: the models are tiny")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        report = {
            "balance": balance(root, args.steps),
            "replay": replay(root),
            "draft_agreement": draft(root, args.steps),
        }
    print(json.dumps(report, indent=1))
    payload = {
        "rows": summary_rows(report, args.steps),
        "settings": vars(args),
        "device": "cpu",
        **report,
    }
    if args.json:
        write_result(args.json, payload)


if __name__ == "__main__":
    main()

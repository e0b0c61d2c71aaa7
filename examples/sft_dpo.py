"""SFT, then DPO, with one worker: NLLLoss on demonstrations, DPOLossFn on preference pairs.

Runs on a CPU in well under a minute; nothing is downloaded (the tiny model is built from a config).
Run: python examples/sft_dpo.py
"""

import tempfile

import torch
from transformers.utils import logging as hf_logging

import policyworker
from policyworker import DPOLossFn, NLLLoss, PolicyWorker
from policyworker.testing import tiny_model_folder

VOCAB, ROWS, SEQ = 64, 8, 10


def batch(ids, prompt_len):
    """A batch whose loss counts only the response tokens (token_mask 0 on the prompt)."""
    token_mask = torch.ones(ids.shape)
    token_mask[:, :prompt_len] = 0
    return {
        "input_ids": ids,
        "input_lengths": torch.full((ids.shape[0],), ids.shape[1]),
        "sample_mask": torch.ones(ids.shape[0]),
        "token_mask": token_mask,
    }


def main(folder):
    hf_logging.disable_progress_bar()  # our own save_pretrained below (the library is quiet)
    tiny_model_folder(folder, "qwen2", vocab=VOCAB, seed=0, tie_word_embeddings=False)
    worker = PolicyWorker(
        {
            "model_name": folder,
            "precision": "float32",
            "train_global_batch_size": ROWS,
            "train_micro_batch_size": ROWS,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-3}},
        }
    )
    print(worker)

    # SFT: teach "the response repeats the prompt's last token".
    prompts = torch.randint(2, VOCAB, (ROWS, 4))
    demos = torch.cat([prompts, prompts[:, -1:].expand(ROWS, SEQ - 4)], dim=1)
    for step in range(3):
        metrics = policyworker.flatten_train_metrics(worker.train(batch(demos, 4), NLLLoss()))
        print(f"sft step {step}: nll {metrics['global_loss']:.4f}")

    # DPO: rows 2i (chosen) and 2i + 1 (rejected) share a prompt; the reference is the
    # worker's start-of-training weights (get_reference_policy_logprobs).
    rejected = torch.cat([prompts, torch.randint(2, VOCAB, (ROWS, SEQ - 4))], dim=1)
    pairs = torch.stack([demos, rejected], dim=1).reshape(2 * ROWS, SEQ)[:ROWS]
    data = batch(pairs, 4)
    data["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(data)[
        "reference_logprobs"
    ]
    dpo = DPOLossFn({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.0})
    for step in range(3):
        metrics = policyworker.flatten_train_metrics(worker.train(data, dpo), prefix="dpo/")
        print(
            f"dpo step {step}: loss {metrics['dpo/global_loss']:.4f} "
            f"accuracy {metrics['dpo/accuracy']:.2f}"
        )
    assert metrics["dpo/rewards_chosen_mean"] > metrics["dpo/rewards_rejected_mean"]
    worker.shutdown()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="sft-dpo-example-") as tmp:
        main(tmp)

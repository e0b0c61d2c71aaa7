"""A minimal GRPO loop: logprobs, reference KL, 3 steps, save/resume, refit into another process.

Runs on a CPU in well under a minute; nothing is downloaded (the tiny model is built from a config).
Run: python examples/grpo_minimal.py
"""

import multiprocessing as mp
import tempfile

import torch
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

import policyworker
from policyworker import (
    ClippedPGLossFn,
    HFWeightReceiver,
    PolicyWorker,
    decode_refit_info,
    encode_refit_info,
)
from policyworker.testing import tiny_model_folder


def inference_process(model_dir, address, refit_info, ids, results):
    """Stands in for vLLM/SGLang: its own copy of the model, updated only through the refit."""
    hf_logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    receiver = HFWeightReceiver(model, address=address, refit_info=decode_refit_info(refit_info))
    receiver.receive()  # one refit: every weight arrives over ZMQ + shared memory
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[:, :-1]
    results.put(logp.gather(-1, ids[:, 1:, None])[..., 0].tolist())


def main(folder):
    policyworker.set_verbosity("info")  # the worker's start-up line and the refit's wait
    hf_logging.disable_progress_bar()  # our own save_pretrained below (the library is quiet)
    model_dir = tiny_model_folder(f"{folder}/model", "llama", vocab=64, seed=0)
    config = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 4,
        "logprob_batch_size": 8,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
    }
    worker = PolicyWorker(config)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.01})
    for step in range(3):
        ids = torch.randint(0, 64, (8, 12))  # your rollout engine's prompts + responses
        data = {
            "input_ids": ids,
            "input_lengths": torch.full((8,), 12),
            "sample_mask": torch.ones(8),
            "token_mask": torch.ones(8, 12),
            "advantages": torch.randn(8, 1).expand(8, 12),
        }  # your rewards, normalised
        data["prev_logprobs"] = worker.get_logprobs(data)["logprobs"]
        data["generation_logprobs"] = data["prev_logprobs"]  # your engine's logprobs
        data["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(data)[
            "reference_logprobs"
        ]
        metrics = policyworker.flatten_train_metrics(worker.train(data, loss_fn))
        print(f"step {step}: loss {metrics['global_loss']:.4f} kl {metrics['kl_penalty']:.5f}")
    worker.save_checkpoint(f"{folder}/weights", f"{folder}/optimizer")
    worker.finalize_async_save()  # saves run in the background; wait before loading
    resumed = PolicyWorker(
        config, weights_path=f"{folder}/weights", optimizer_path=f"{folder}/optimizer"
    )
    logprobs = worker.get_logprobs(data)["logprobs"]
    same = torch.equal(resumed.get_logprobs(data)["logprobs"], logprobs)
    print(f"resumed from {folder}/weights: logprobs identical = {same}")
    context = mp.get_context("spawn")
    results = context.Queue()
    child = context.Process(
        target=inference_process,
        args=(
            model_dir,
            resumed.get_zmq_address(),
            encode_refit_info(resumed.prepare_refit_info()),
            ids,
            results,
        ),
    )
    child.start()
    report = resumed.stream_weights_via_ipc_zmq()
    received = torch.tensor(results.get(timeout=120))  # the inference process's logprobs
    gap = (received - resumed.get_logprobs(data)["logprobs"][:, 1:]).abs().max()
    child.join(timeout=60)
    print(
        f"refit: {report['num_tensors']} tensors, {report['num_bytes']} bytes; "
        f"max |logprob gap| trainer vs inference process = {float(gap):.2e}"
    )
    assert same and float(gap) < 1e-4, "resume or refit did not reproduce the trained weights"
    resumed.shutdown()
    worker.shutdown()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="grpo-example-") as tmp:
        main(tmp)

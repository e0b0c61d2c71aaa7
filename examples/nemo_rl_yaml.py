"""A worker and its loss from a NeMo-RL YAML file (examples/nemo_rl_grpo.yaml): one GRPO step.

The file's `policy:` block builds the worker (interpolations such as `${mul:...}` resolved,
dotted overrides applied) and its `loss_fn:` block builds ClippedPGLossFn. Nothing is
downloaded: `model_name` is overridden to point at a tiny model built from a config.
Run: python examples/nemo_rl_yaml.py
"""

import pathlib
import tempfile

import torch
from transformers.utils import logging as hf_logging

from policyworker import ClippedPGLossFn, PolicyWorker, flatten_train_metrics
from policyworker.config.files import load_config_file, log_config, read_config_section
from policyworker.testing import tiny_model_folder

YAML = pathlib.Path(__file__).with_name("nemo_rl_grpo.yaml")


def main(folder):
    hf_logging.disable_progress_bar()  # our own save_pretrained below (the library is quiet)
    tiny_model_folder(folder, "llama", vocab=64)
    config = load_config_file(YAML, overrides=[f"model_name={folder}"])
    print("policy config:", log_config(config)[:120], "...")
    print("precision:", config.precision, "| dynamic batching:", config.dynamic_batching)
    loss_fn = ClippedPGLossFn(read_config_section(YAML, "loss_fn"))
    worker = PolicyWorker(config)
    lengths = torch.tensor([16, 12, 9, 16, 5, 16, 11, 7])  # ragged: dynamic batching groups them
    ids = torch.randint(0, 64, (8, 16))
    data = {
        "input_ids": ids,
        "input_lengths": lengths,
        "sample_mask": torch.ones(8),
        "token_mask": torch.ones(8, 16),
        "advantages": torch.randn(8, 1).expand(8, 16),
    }
    data["prev_logprobs"] = worker.get_logprobs(data)["logprobs"]
    data["generation_logprobs"] = data["prev_logprobs"]
    data["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(data)[
        "reference_logprobs"
    ]
    metrics = flatten_train_metrics(worker.train(data, loss_fn), prefix="train/")
    print({k: round(v, 5) for k, v in sorted(metrics.items())})
    worker.shutdown()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="nemo-rl-yaml-example-") as tmp:
        main(tmp)

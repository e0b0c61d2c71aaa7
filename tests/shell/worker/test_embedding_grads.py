"""Every token's embedding row trains: the worker's embedding gradient equals plain HF's.

A model whose config has no pad id must not get one before construction: transformers would
build `nn.Embedding(padding_idx=pad)` and that row (EOS, when pad falls back to EOS) would never
receive a gradient. The reference here is a plain HF forward/backward of the same batch with the
same loss; the worker's gradient is read just before its optimizer step.
"""

from __future__ import annotations

import pytest
import torch

from policyworker.functional.loss import NLLLoss
from policyworker.shell.worker.policy_worker import PolicyWorker
from policyworker.testing import tiny_model_folder
from tests.shell.conftest import VOCAB, make_batch, make_config

EOS = 1  # the tiny models' eos_token_id
BATCHINGS = {
    "fixed": {"train_micro_batch_size": 2},
    "dynamic": {"dynamic_batching": {"train_mb_tokens": 24, "sequence_length_round": 4}},
    "packed": {"sequence_packing": {"train_mb_tokens": 24}},
}


def _batch_with_eos_mid_sequence() -> dict:
    data = make_batch(4, 12, seed=21, lengths=[12, 9, 7, 12])
    data["input_ids"][:, 3] = EOS  # EOS closes a "turn" inside every row
    data["input_ids"][1, 6] = EOS
    data["token_mask"][:, 4] = 1.0  # the token after each EOS is trained on, so EOS's row matters
    return data


def _plain_hf_embedding_grad(model_path: str, data: dict) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = data["input_ids"]
    logits = model(input_ids=ids, use_cache=False).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    valid = torch.arange(1, ids.shape[1])[None] < data["input_lengths"][:, None]
    mask = mask * valid
    loss = -(logprobs * mask).sum() / mask.sum()
    loss.backward()
    return model.get_input_embeddings().weight.grad.detach().clone()


def _worker_embedding_grad(worker: PolicyWorker, data: dict) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    weight = worker.model.get_input_embeddings().weight

    def keep(_optimizer, _args, _kwargs):
        captured.append(weight.grad.detach().clone())

    handle = worker.optimizer.register_step_pre_hook(keep)
    try:
        result = worker.train(data, NLLLoss())
    finally:
        handle.remove()
    assert result["skipped_steps"] == 0 and len(captured) == 1
    return captured[0]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory, tiny_model_paths, tiny_tokenizer_model_path) -> dict[str, str]:
    """No pad id (EOS becomes the tokenizer's pad), and an explicit pad id in the config."""
    folder = tmp_path_factory.mktemp("with_pad") / "llama"
    tiny_model_folder(
        folder,
        vocab=VOCAB,
        init_std=0.2,
        pad_token_id=0,
        use_cache=True,
        eos_token_id=EOS,
        bos_token_id=2,
    )
    return {
        "no_pad_id": tiny_model_paths["llama"],
        "no_pad_id_tokenizer_pads_with_eos": tiny_tokenizer_model_path,
        "pad_id_in_config": str(folder),
    }


@pytest.mark.parametrize("batching", sorted(BATCHINGS))
@pytest.mark.parametrize(
    "model", ["no_pad_id", "no_pad_id_tokenizer_pads_with_eos", "pad_id_in_config"]
)
def test_every_token_row_gets_the_plain_hf_embedding_gradient(model_paths, model, batching):
    data = _batch_with_eos_mid_sequence()
    cfg = make_config(
        model_paths[model], max_grad_norm=None, train_global_batch_size=4, **BATCHINGS[batching]
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    ours = _worker_embedding_grad(worker, data)
    reference = _plain_hf_embedding_grad(model_paths[model], data)
    present = torch.unique(data["input_ids"])
    assert EOS in present.tolist() and 0 in present.tolist()  # EOS mid-row, 0 as padding
    # fp32 summation-order noise only: packing reorders the per-token sums (measured <= 3.1e-7
    # here, thread-count dependent); the frozen-row bug this guards against was off by ~1.2.
    tolerance = {"rtol": 1e-5, "atol": 1e-6 if batching == "packed" else 1e-7}
    torch.testing.assert_close(ours[present], reference[present], **tolerance)
    assert reference[EOS].norm() > 0 and ours[EOS].norm() > 0  # EOS trains
    torch.testing.assert_close(ours, reference, **tolerance)  # rows not present: 0


def test_the_model_keeps_the_pad_id_its_checkpoint_describes(model_paths, tmp_path):
    worker = PolicyWorker(
        make_config(model_paths["no_pad_id_tokenizer_pads_with_eos"]), init_reference_model=False
    )
    assert worker.model.config.pad_token_id is None
    assert worker.model.get_input_embeddings().padding_idx is None
    with_pad = PolicyWorker(
        make_config(model_paths["pad_id_in_config"]), init_reference_model=False
    )
    assert with_pad.model.get_input_embeddings().padding_idx == 0  # as plain HF builds it


def test_lora_worker_leaves_the_embedding_frozen_and_trains_its_adapters(model_paths):
    # LoRA adapts linear layers only (the embedding is never a LoRA target), so the base
    # embedding must not move and the adapters must: the pad fix does not change that.
    cfg = make_config(
        model_paths["no_pad_id"],
        max_grad_norm=None,
        dtensor_cfg={"lora_cfg": {"enabled": True, "dim": 4, "alpha": 8}},
    )
    worker = PolicyWorker(cfg, init_reference_model=False)
    embedding = worker.model.get_input_embeddings().weight
    before = embedding.detach().clone()
    assert not embedding.requires_grad
    worker.train(_batch_with_eos_mid_sequence(), NLLLoss())
    assert torch.equal(embedding.detach(), before)
    assert embedding.shape[0] == VOCAB

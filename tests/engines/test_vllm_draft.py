"""A real vLLM engine (CPU, fp32) with an EAGLE3 speculative drafter, refit from a PolicyWorker
that co-trains a draft (`policy.draft`).

vLLM 0.32's CPU build runs EAGLE3 speculative decoding. The engine starts from the draft folder
of the worker's checkpoint (`weights_path/draft`, a Hugging Face Eagle3 draft); after the worker
trained, one refit carries the policy and the `draft.*` tensors, and vLLM's drafter holds the
trained draft (its norms are read back in vLLM's worker; the receiver refuses a version that
leaves any drafter parameter without a value). Speculative decoding is lossless: vLLM's greedy
tokens stay the policy's argmax. And the trained draft is what vLLM speculates with: its
acceptance rate goes from near 0 (the fresh draft) to near 1 once the draft agrees with the
policy (measured 0.006 -> 1.0), which also checks the aux-layer numbering vLLM reads.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.vllm_helpers import PROMPTS, TINY_LLAMA, engine, generate, require_vllm

require_vllm()

from policyworker.functional.loss import NLLLoss  # noqa: E402
from policyworker.shell.engines.vllm import VllmRefit  # noqa: E402
from policyworker.shell.worker.policy_worker import PolicyWorker  # noqa: E402
from tests.engines.vllm_helpers import hf_continuation, tiny_model  # noqa: E402
from tests.shell.conftest import make_batch, make_config  # noqa: E402

pytestmark = pytest.mark.slow

# RMSNorm weights are the drafter's parameters vLLM's CPU build keeps as they were loaded (its
# linear layers are repacked into kernels and their `weight` emptied).
NORMS = ("norm", "layers.0.input_layernorm", "layers.0.hidden_norm")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_draft")


@pytest.fixture(scope="module")
def checkpoint(root) -> str:
    """A policy + fresh draft checkpoint: the engine's drafter starts from its draft folder."""
    from transformers import LlamaConfig

    tiny_model(LlamaConfig(**TINY_LLAMA), seed=0).save_pretrained(root / "model")
    torch.manual_seed(0)  # the fresh draft
    worker = PolicyWorker(_config(root), init_reference_model=False)
    worker.save_checkpoint(str(root / "step0"), is_final_checkpoint=True)
    worker.shutdown()
    return str(root / "step0")


def _config(root) -> dict:
    return make_config(str(root / "model"), draft={"loss_weight": 1.0})


@pytest.fixture
def worker(root, checkpoint):
    """A worker resumed from the checkpoint (its own refit address per test)."""
    worker = PolicyWorker(_config(root), weights_path=checkpoint, init_reference_model=False)
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def llm(checkpoint):
    spec = {"method": "eagle3", "model": f"{checkpoint}/draft", "num_speculative_tokens": 2}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the read-back RPC is a function
        with engine(
            f"{checkpoint}/../model", speculative_config=spec, disable_log_stats=False
        ) as llm:
            yield llm


def _drafter_norms(worker_self) -> dict[str, list[float]]:
    """Runs in vLLM's worker: the drafter's RMSNorm weights."""
    draft = worker_self.model_runner.get_draft_model()
    params = dict(draft.named_parameters())
    return {name: params[f"model.{name}.weight"].tolist() for name in NORMS}


def _assert_greedy_is_the_policys(llm, policy) -> None:
    for prompt, (tokens, _) in zip(PROMPTS, generate(llm, PROMPTS, max_tokens=6), strict=True):
        greedy, _ = hf_continuation(policy, prompt, tokens)
        assert tokens == greedy


@pytest.mark.parametrize("via", ["weight_transfer", "extension"])
def test_a_refit_puts_the_trained_draft_into_vllms_drafter(llm, worker, via):
    for step in range(2):  # other batches per case: each refit changes what vLLM serves
        worker.train(make_batch(8, 12, seed=10 * len(via) + step), NLLLoss())
    draft = worker.state.draft.model
    want = {name: draft.get_submodule(name).weight.tolist() for name in NORMS}
    before = llm.collective_rpc(_drafter_norms)[0]
    assert before != want  # the engine serves an older draft
    report = VllmRefit(llm, worker, via=via).refit()
    assert report["num_tensors"] == len(worker.prepare_refit_info())
    got = llm.collective_rpc(_drafter_norms)[0]
    for name in NORMS:
        torch.testing.assert_close(
            torch.tensor(got[name]), torch.tensor(want[name]), rtol=0, atol=0
        )
    _assert_greedy_is_the_policys(llm, worker.model)


def _acceptance(llm, prompts) -> tuple[float, int]:
    """(accepted / proposed draft tokens, proposed) over one greedy generation of `prompts`."""

    def counts() -> tuple[float, float]:
        names = ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens")
        metrics = {m.name: m for m in llm.get_metrics() if m.name in names}
        return metrics[names[0]].value, metrics[names[1]].value

    accepted, proposed = counts()
    generate(llm, prompts, max_tokens=12)
    now_accepted, now_proposed = counts()
    proposed = int(now_proposed - proposed)
    return (now_accepted - accepted) / max(proposed, 1), proposed


def test_vllm_speculates_with_the_refit_draft(llm, worker):
    from tests.shell.worker.test_draft import _affine_batch

    prompts = [row[:4].tolist() for row in _affine_batch(8, seed=999)["input_ids"]]
    VllmRefit(llm, worker).refit()  # the fresh draft of the checkpoint
    fresh, proposed = _acceptance(llm, prompts)
    for step in range(12):
        out = worker.train(_affine_batch(8, seed=step), NLLLoss())
    agreement = sum(out["all_mb_metrics"]["draft_top1_agreement"])
    VllmRefit(llm, worker).refit()
    trained, _ = _acceptance(llm, prompts)
    print(f"vLLM draft acceptance: fresh {fresh:.3f} ({proposed} proposed), trained {trained:.3f}")
    assert proposed > 0 and fresh < 0.2, fresh
    assert agreement > 0.8 and trained > 0.8, (agreement, trained)

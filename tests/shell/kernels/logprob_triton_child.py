"""Run by tests/shell/kernels/test_logprob_triton.py under TRITON_INTERPRET=1 (Triton's CPU
interpreter reads the env at import, so it needs a fresh process): the Triton pair against the
eager pair."""

import torch

from policyworker.functional.logprob_kernels import (
    EAGER_KERNELS,
    plain_entropy,
    plain_logprob_grad,
    plain_logprobs_and_lse,
)
from policyworker.shell.kernels.fused_logprobs import (
    LOGPROB_ATOL,
    LOGPROB_RTOL,
    assert_logprob_grads_close,
)
from policyworker.shell.kernels.logprob_triton import (
    TRITON_KERNELS,
    triton_entropy,
    triton_logprob_grad,
    triton_logprobs_and_lse,
)
from tests.shell.kernels.test_fused_logprobs import _scored, assert_scored_grads_close


def check_through_next_token_logprobs(vocab: int, rows: int, positions: int, temperature: float):
    gen = torch.Generator().manual_seed(vocab + rows + positions)
    logits = (5 * torch.randn(rows, positions, vocab, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (rows, positions), generator=gen)
    weights = torch.randn(rows, positions - 1, generator=gen)
    want, want_grad = _scored(EAGER_KERNELS, logits, ids, weights, temperature)
    got, got_grad = _scored(TRITON_KERNELS, logits, ids, weights, temperature)
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    assert got_grad.dtype == torch.bfloat16
    assert_scored_grads_close(got_grad, want_grad, logits, weights, temperature)
    assert torch.equal(got_grad[:, -1], torch.zeros_like(got_grad[:, -1]))


def check_a_slice_of_positions_and_a_padding_row(temperature: float):
    """A [B, C, V] view with row strides of a longer block is read in place; lse = +inf with
    grad 0 (a padding position) gives an exact zero gradient row."""
    gen = torch.Generator().manual_seed(7)
    block = (3 * torch.randn(2, 7, 9000, generator=gen)).to(torch.bfloat16)
    logits, ids = block[:, 1:6], torch.randint(0, 9000, (2, 5), generator=gen)
    got_lp, got_lse = triton_logprobs_and_lse(logits, ids, temperature)
    want_lp, want_lse = plain_logprobs_and_lse(logits, ids, temperature)
    torch.testing.assert_close(got_lp, want_lp, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    torch.testing.assert_close(got_lse, want_lse, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    lse, grad = want_lse.clone(), torch.randn(2, 5, generator=gen)
    lse[1, 3], grad[1, 3] = float("inf"), 0.0
    got = triton_logprob_grad(logits, ids, lse, grad, temperature)
    want = plain_logprob_grad(logits, ids, lse, grad, temperature)
    assert_logprob_grads_close(got, want, logits=logits, grad=grad, temperature=temperature)
    assert got.is_contiguous() and torch.equal(got[1, 3], torch.zeros_like(got[1, 3]))


def check_entropy(vocab: int, temperature: float):
    """The one-read entropy against the eager one: peaked and flat rows, a row whose max comes
    late (the running sums move to a new max in a later block), and a strided slice."""
    gen = torch.Generator().manual_seed(vocab)
    block = torch.randn(3, 6, vocab, generator=gen) * torch.tensor([0.1, 5.0, 40.0])[:, None, None]
    block[0, 2, -1] = 60.0  # the max in the last block
    block = block.to(torch.bfloat16)
    logits = block[:, 1:5]  # positions of a longer block, read in place
    got, want = triton_entropy(logits, temperature), plain_entropy(logits, temperature)
    assert got.dtype == torch.float32 and got.shape == (3, 4)
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)


if __name__ == "__main__":
    for temperature in (1.0, 0.7):
        # one block, several blocks with a ragged last one (4096 logits per block)
        for vocab, rows, positions in ((97, 3, 5), (9000, 1, 6)):
            check_through_next_token_logprobs(vocab, rows, positions, temperature)
        check_a_slice_of_positions_and_a_padding_row(temperature)
        for vocab in (97, 9000):
            check_entropy(vocab, temperature)
    print("triton logprob kernels match the eager pair")

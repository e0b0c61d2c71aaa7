"""The packed-document flash kernel on CUDA: per-document causal attention, forward and backward."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from policyworker.shell.model import attention

pytestmark = pytest.mark.gpu

LENGTHS = [37, 1, 128, 64, 5, 200]
Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _packed_qkv(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(LENGTHS)

    def rand(heads):
        x = torch.randn(total, heads, HEAD_DIM, device="cuda", generator=gen)
        return x.to(torch.bfloat16).requires_grad_()

    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return rand(Q_HEADS), rand(KV_HEADS), rand(KV_HEADS), cu.cuda(), max(LENGTHS)


def _per_document_sdpa(q, k, v, cu, scale):  # the reference: one causal sdpa call per document
    outs = []
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qd, kd, vd = (t[start:end].float().transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def test_flash_varlen_matches_per_document_causal_attention_with_gqa_forward_and_backward():
    q, k, v, cu, max_len = _packed_qkv(seed=3)
    scale = HEAD_DIM**-0.5
    got = attention._flash_varlen(q, k, v, cu, max_len, scale)
    grad_out = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    want = _per_document_sdpa(q, k, v, cu, scale)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    assert got.shape == (sum(LENGTHS), Q_HEADS, HEAD_DIM)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16 output rounding
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=5e-2, rtol=5e-2)


def test_flash_varlen_is_bitwise_torchs_varlen_wrapper_and_traces_under_compile():
    q, k, v, cu, max_len = _packed_qkv(seed=4)
    scale = HEAD_DIM**-0.5
    ours = attention._flash_varlen(q, k, v, cu, max_len, scale)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:  # same kernel behind torch's Python wrapper: same bits
        rep = Q_HEADS // KV_HEADS
        kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        params = inspect.signature(varlen_attn).parameters
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        theirs = varlen_attn(q, kr, vr, cu, cu, max_len, max_len, scale=scale, **causal)
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    compiled = torch.compile(attention._flash_varlen, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, cu, max_len, scale), ours, atol=0, rtol=0)

"""block_attention against autograd of plain attention on one process (float32, 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from meshspeed.sequence.block_attention import (
    block_backward,
    block_forward,
    compute_delta,
    merge,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _qkv(b=2, h_q=4, h_kv=2, l_q=6, l_k=10, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, n: torch.randn(b, h, n, d, generator=g).to(dtype)
    return make(h_q, l_q), make(h_kv, l_k), make(h_kv, l_k)


def _reference(q, k, v, scale, causal):
    """Plain attention with repeated kv heads: (out, lse), differentiable."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _grads(q, k, v, scale, causal, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = _reference(*leaves, scale, causal)
    out.backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("causal_diag,h_kv,l_q", [(False, 2, 6), (False, 4, 10), (True, 2, 10),
                                                  (True, 1, 10)])
def test_one_block_matches_autograd(causal_diag, h_kv, l_q):
    q, k, v = _qkv(h_kv=h_kv, l_q=l_q)
    scale = 1 / math.sqrt(q.size(-1))
    out, lse = block_forward(q, k, v, scale, causal_diag)
    ref_out, ref_lse = _reference(q, k, v, scale, causal_diag)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert_close(out, ref_out, **TOL)
    assert_close(lse, ref_lse, **TOL)

    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, compute_delta(dout, out), scale,
                                causal_diag)
    for got, want in zip((dq, dk, dv), _grads(q, k, v, scale, causal_diag, dout)):
        assert got.shape == want.shape
        assert_close(got, want, **TOL)


def test_merge_of_two_halves_is_the_whole_and_backward_uses_the_merged_lse():
    # Keys 0..9 split into 0..3 (full) and 4..9: merged halves equal attention over all 10;
    # the two halves' backward with the merged out/lse sum to the whole gradient.
    q, k, v = _qkv(l_q=6, l_k=10)
    scale = 0.3
    halves = [(k[:, :, :4], v[:, :, :4]), (k[:, :, 4:], v[:, :, 4:])]
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))  # rows that have seen nothing yet
    for kh, vh in halves:
        out, lse = merge(out, lse, *block_forward(q, kh, vh, scale, False))
    ref_out, ref_lse = _reference(q, k, v, scale, False)
    assert_close(out, ref_out, **TOL)
    assert_close(lse, ref_lse, **TOL)

    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    delta = compute_delta(dout, out)
    parts = [block_backward(dout, q, kh, vh, out, lse, delta, scale, False) for kh, vh in halves]
    dq = parts[0][0] + parts[1][0]
    dk = torch.cat([parts[0][1], parts[1][1]], 2)
    dv = torch.cat([parts[0][2], parts[1][2]], 2)
    for got, want in zip((dq, dk, dv), _grads(q, k, v, scale, False, dout)):
        assert_close(got, want, **TOL)


def test_merge_of_empty_rows_stays_empty():
    out, lse = torch.zeros(1, 1, 3, 2), torch.full((1, 1, 3), float("-inf"))
    merged, merged_lse = merge(out, lse, out.clone(), lse.clone())
    assert not merged.isnan().any() and (merged == 0).all()
    assert (merged_lse == float("-inf")).all()
    blk, blk_lse = torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3)
    merged, merged_lse = merge(out, lse, blk, blk_lse)  # the first block seen: itself
    assert_close(merged, blk)
    assert_close(merged_lse, blk_lse)


def test_bfloat16_inputs_compute_in_float32():
    # bf16 -> fp32 is exact, so the result equals fp32 math on the rounded inputs.
    q, k, v = _qkv(l_q=10, dtype=torch.bfloat16)
    out, lse = block_forward(q, k, v, 0.25, True)
    assert out.dtype == lse.dtype == torch.float32
    ref_out, ref_lse = _reference(q.float(), k.float(), v.float(), 0.25, True)
    assert_close(out, ref_out, **TOL)
    assert_close(lse, ref_lse, **TOL)


def test_causal_diag_needs_blocks_of_one_length():
    q, k, v = _qkv(l_q=6, l_k=10)
    with pytest.raises(ValueError, match="causal_diag"):
        block_forward(q, k, v, 1.0, True)


@pytest.mark.parametrize("causal_diag, h_kv", [(True, 4), (False, 2), (True, 1)])
def test_fused_cpu_kernel_equals_the_plain_math(causal_diag, h_kv, monkeypatch):
    """Note [a fused kernel on the CPU]: float32 runs torch's flash kernel; with it taken
    away the same calls run the plain math, and both give the same block results (the
    backward from a merged out/lse, as the ring calls it)."""
    import meshspeed.sequence.block_attention as ba

    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(2))
    k, v, k2, v2 = (torch.randn(2, h_kv, 12, 8, generator=g) for _ in range(4))

    def run():
        out, lse = ba.merge(*ba.block_forward(q, k, v, 0.3, causal_diag), *ba.block_forward(q, k2, v2, 0.3, False))
        return (out, lse, *ba.block_backward(dout, q, k, v, out, lse, ba.compute_delta(dout, out), 0.3,
                                             causal_diag))

    assert ba._fused(q)
    fused = run()
    monkeypatch.setattr(ba, "_FLASH", None)
    assert not ba._fused(q)
    for got, want in zip(fused, run()):
        assert_close(got, want, atol=2e-6, rtol=1e-5)

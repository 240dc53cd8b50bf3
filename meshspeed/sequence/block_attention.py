"""Attention of one query block against one key/value block: the ring's kernel (torch's
fused CPU flash kernel where it applies, plain torch math otherwise).

    out, lse = block_forward(q, k, v, scale, causal_diag=False)
    out, lse = merge(out, lse, *block_forward(q, k2, v2, scale, causal_diag=True))
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, compute_delta(dout, out), scale, False)

Shapes (SDPA layout): q [b, h_q, L_q, d], k and v [b, h_kv, L_k, d] with h_kv dividing
h_q; query head i reads key/value head i // (h_q / h_kv), as SDPA's `enable_gqa` does.
`lse` is [b, h_q, L_q]: the natural log of each row's softmax denominator of the scaled
scores. `causal_diag=True` says the two blocks hold the same positions (L_q == L_k), so
query j sees keys 0..j only.

Note [block attention precision]
Everything is computed in the accumulation dtype: float32 for float32, bfloat16 and
float16 inputs, float64 for float64. Results (out, lse, dq, dk, dv) are returned in that
dtype, not cast back: the ring adds many of them up, and rounding each partial result to
bfloat16 would lose what the float32 accumulation kept. The caller casts once at the end.

Note [grouped heads without repeats]
For grouped-query attention the g = h_q / h_kv query heads of one key/value head are
stacked along the row dimension, q viewed as [b, h_kv, g * L_q, d], so every product is
one batched matmul over the h_kv heads and k, v are never repeated g times. The backward
products then sum over the g query heads by themselves (dK = dS^T Q contracts over the
stacked rows).

Note [rows that have seen nothing]
A row's accumulated lse is -inf until a block it can see has been merged into it. Merging
two -inf rows gives weight exp(-inf - -inf) = nan; `merge` gives such rows weight 0 (out
stays 0, lse stays -inf), and `block_backward` treats an lse of -inf as "no probability
anywhere" (P = 0) rather than exp(s + inf).

Note [a fused kernel on the CPU]
Plain math materialises the scores of the whole block pair, [h, L_q, L_k] (twice in
backward): memory quadratic in the tokens per rank, which made the ring's longest
sequence under a memory cap no longer than one rank's (benchmarks/long_context.py). On
the CPU in float32, torch's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`)
works in tiles and returns the log-sum-exp, and its backward takes the out and lse it is
given: handed the merged (final) ones, it computes exactly this block's share of the
gradients, as `block_backward` does. It handles grouped-query heads itself. Float64
inputs, other devices, and torch builds without the op use the plain math, which is also
the reference the tests hold the kernel to.
"""

from __future__ import annotations

import torch

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor) -> bool:
    """Whether the fused CPU kernel applies (Note [a fused kernel on the CPU])."""
    return (_FLASH is not None and _FLASH_BACKWARD is not None and q.device.type == "cpu"
            and accumulation_dtype(q.dtype) == torch.float32)


def _check_diag(l_q: int, l_k: int, causal_diag: bool) -> None:
    if causal_diag and l_q != l_k:
        raise ValueError(
            f"causal_diag needs query and key blocks of the same positions, got "
            f"{l_q} queries and {l_k} keys; pass causal_diag=False for distinct blocks")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype block attention computes and accumulates in (Note [block attention precision])."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, h_kv: int) -> torch.Tensor:
    """[b, h_q, L, d] -> [b, h_kv, g * L, d] (Note [grouped heads without repeats])."""
    b, h, length, d = x.shape
    return x.reshape(b, h_kv, (h // h_kv) * length, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal_diag: bool) -> torch.Tensor:
    """Scaled scores [b, h_kv, g * L_q, L_k] in the accumulation dtype, -inf where masked."""
    h_kv, l_q, l_k = k.size(1), q.size(2), k.size(2)
    acc = accumulation_dtype(q.dtype)
    s = torch.matmul(_grouped(q.to(acc), h_kv), k.to(acc).transpose(-1, -2)).mul_(scale)
    _check_diag(l_q, l_k, causal_diag)
    if causal_diag:
        hidden = torch.ones(l_q, l_k, dtype=torch.bool, device=q.device).triu_(1)
        s.view(*s.shape[:2], -1, l_q, l_k).masked_fill_(hidden, float("-inf"))
    return s


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_diag: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v of one block pair, and each row's log-sum-exp.

    Returns out [b, h_q, L_q, d] and lse [b, h_q, L_q], both in the accumulation dtype.
    """
    b, h_q, l_q, _ = q.shape
    if _fused(q):
        _check_diag(l_q, k.size(2), causal_diag)
        f32 = torch.float32
        return _FLASH(q.to(f32), k.to(f32), v.to(f32), 0.0, causal_diag, scale=scale)
    s = _scores(q, k, scale, causal_diag)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = s.sub_(lse).exp_()  # in place: s is not needed again
    out = torch.matmul(p, v.to(s.dtype))  # [b, h_kv, g * L_q, d]
    return out.view(b, h_q, l_q, -1), lse.view(b, h_q, l_q)


def merge(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions of the same queries over disjoint key sets.

    Each out is normalised over its own keys; the result is normalised over both:
    lse = log(e^lse_acc + e^lse_blk), out = e^(lse_acc - lse) out_acc + e^(lse_blk - lse)
    out_blk. Rows where both lse are -inf stay (0, -inf) (Note [rows that have seen nothing]).
    """
    lse = torch.logaddexp(lse_acc, lse_blk)
    pivot = lse.masked_fill(lse == float("-inf"), 0.0)
    w_acc = torch.exp(lse_acc - pivot).unsqueeze(-1)
    w_blk = torch.exp(lse_blk - pivot).unsqueeze(-1)
    return out_acc * w_acc + out_blk * w_blk, lse


def compute_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) [b, h_q, L_q] in the accumulation dtype, from the final (merged) out."""
    acc = accumulation_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    causal_diag: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block pair's share of the gradients of the whole attention.

    `out`, `lse` and `delta` are of the final attention over every key block (the merged
    result), so P = exp(S * scale - lse) is this block's part of the full softmax:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ = dS K scale, dK = dS^T Q scale.
    The plain path uses `out` only through `delta`; the fused kernel forms delta itself.
    Returns dq [b, h_q, L_q, d], dk and dv [b, h_kv, L_k, d] in the accumulation dtype.
    """
    b, h_q, l_q, _ = q.shape
    if _fused(q):  # the kernel forms delta from dout and out itself
        _check_diag(l_q, k.size(2), causal_diag)
        f32 = torch.float32
        return _FLASH_BACKWARD(dout.to(f32), q.to(f32), k.to(f32), v.to(f32), out.to(f32), lse.to(f32),
                               0.0, causal_diag, scale=scale)
    del out  # enters only through delta
    h_kv = k.size(1)
    s = _scores(q, k, scale, causal_diag)
    acc = s.dtype
    lse = lse.to(acc).masked_fill(lse == float("-inf"), float("inf"))  # P = 0 on such rows
    p = s.sub_(_grouped(lse.unsqueeze(-1), h_kv)).exp_()  # [b, h_kv, g * L_q, L_k]
    do = _grouped(dout.to(acc), h_kv)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(acc).transpose(-1, -2))
    ds = dp.sub_(_grouped(delta.to(acc).unsqueeze(-1), h_kv)).mul_(p).mul_(scale)
    dq = torch.matmul(ds, k.to(acc)).view(b, h_q, l_q, -1)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.to(acc), h_kv))
    return dq, dk, dv

"""DeepSpeed-Ulysses (arXiv:2309.14509): attention over a sequence split across ranks.

    attn = DistributedAttention(local_attention, group)           # DeepSpeed's module
    out = attn(q, k, v, batch_dim_idx)                             # [s/P, b, h, d] in and out
    out = ulysses_attention(q, k, v, group, causal=True)           # [b, h, s/P, d] in and out

Every rank holds every head of its slice of the sequence (contiguous slices, rank order =
sequence order). An all-to-all (all_to_all.py) trades that for every token of 1/P of the
heads; attention runs there, per head, exactly as on one process; a second all-to-all
trades the output back.

Note [Ulysses communication volume]
Per attention call, with P ranks, local sequence s = S/P, batch b, head_dim d, e bytes an
element, h query heads and h_kv key/value heads, each rank sends (the counter's bytes,
Note [ring bytes]: an all-to-all keeps 1/P of its input and sends the rest):

    forward   (P-1)/P * e*b*s*d * (h + 2 h_kv')     q, k, v: heads -> sequence
            + (P-1)/P * e*b*s*d * h                 output: sequence -> heads
    backward  the same again (each all-to-all's backward is its mirror image)

h_kv' = h_kv when P divides h_kv. When h_kv < P (and divides it), each key/value head is
replicated P/h_kv times before the all-to-all, so that query head group j finds its
key/value head on rank j: h_kv' = P, and k and v cost as much as P query heads. With
multi-head attention the forward is 4 (P-1)/P * e*b*s*d*h = 4 (P-1)/P * e*b*N*H/P for
sequence length N and hidden size H, the paper's 4NH/P per link (section 3.2): constant
when N and P grow together, which is what Ulysses is for. q, k and v share one
collective and the output takes a second, mirrored in the backward: 4 calls (on CPU q, k
and v share only while they fit all_to_all.py's CPU_BUCKET_BYTES, Note [buckets]). The
exception is a local attention of the caller's in a layout where the gathered sequence is
the outermost dimension ([s, b, h, d], or [b, s, h, d] at b = 1): there separate exchanges
give contiguous results without a copy, which the caller's attention may need (`.view`),
where a shared buffer gives non-contiguous views; the bytes are the same, the calls 3 + 1
each way.

Note [grouped-query heads]
With h_kv key/value heads each shared by h/h_kv query heads, rank j receives query heads
[j h/P, (j+1) h/P). When P divides h_kv it receives key/value heads [j h_kv/P, (j+1)
h_kv/P), exactly the ones those query heads use, and the local attention sees h/P query
and h_kv/P key/value heads (the default one passes `enable_gqa`). When h_kv divides P,
repeat_interleave makes P key/value heads, copy m of head m // (P/h_kv), so rank j gets
the one head its queries use; autograd sums the copies' gradients back into the head.
Anything else splits a group across ranks and is refused.

Note [DeepSpeed's layouts]
The heads are at `scatter_idx`, the sequence at `gather_idx`, the batch at the remaining
one of the first three dimensions, head_dim last: DeepSpeed's [s, b, h, d] is
(scatter_idx=2, gather_idx=0), batch-first [b, s, h, d] (2, 1), and SDPA's [b, h, s, d]
(1, 2) works too. When `batch_dim_idx` is passed it decides, as in DeepSpeed 0.19.8,
whose even-split path reads the layout from batch_dim_idx alone: batch at batch_dim_idx,
sequence at the remaining dimension, whatever gather_idx says (scripts that run batch-first
with the default gather_idx=0 exist). Omitted, it is the dimension that is neither heads,
sequence nor last (older scripts omit it). `rotary_pos_emb` is DeepSpeed's too: a (cos,
sin) pair of 4-d tensors with dims 0 and 1 swapped against the gathered q and k
(Megatron's [S, 1, 1, rot] for batch-first q, [1, S, 1, rot] for [s, b, h, d]), applied
to the first `rot` features of every head after the first all-to-all, rotate-half style.
`sp_stream` (DeepSpeed overlaps its q and k exchanges with the caller's work on that CUDA
stream) is accepted and unused: meshspeed sends q, k and v in one collective instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.sequence.all_to_all import seq_all_to_all, seq_all_to_all_many

__all__ = ["DistributedAttention", "ulysses_attention"]


class DistributedAttention(nn.Module):
    """DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`.

    `local_attention(q, k, v, *args, **kwargs)` runs on every token of h/P heads, in the
    layout of the inputs (e.g. [S, b, h/P, d]), on contiguous tensors, after
    `rotary_pos_emb` if given; None uses `scaled_dot_product_attention` (keywords `causal`,
    default True, and `scale`; extra forward arguments go to SDPA, `is_causal=False` with
    an `attn_mask`). `sequence_process_group` None is the default group. `num_kv_heads`, if
    given, must be the key's head count. Layouts and rotary: Note [DeepSpeed's layouts];
    volume: Note [Ulysses communication volume]; GQA: Note [grouped-query heads].
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor] | None = None,
        sequence_process_group: Any = None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
        *,
        causal: bool = True,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        if scatter_idx not in (0, 1, 2):
            raise ValueError(
                f"DistributedAttention: scatter_idx={scatter_idx} must be the heads dimension, one of "
                f"0, 1, 2 (head_dim is last); DeepSpeed's [s, b, h, d] and [b, s, h, d] use 2")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream  # Note [DeepSpeed's layouts]: accepted, unused
        self.num_kv_heads = num_kv_heads
        self.causal, self.scale = causal, scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int | None = None,
        rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """q, k, v: this rank's slice of the sequence, all heads; returns the attention
        output for that slice, in the same layout."""
        lay = _layout(query, self.scatter_idx, self.gather_idx, batch_dim_idx)
        n = comm.get_world_size(self.spg)
        if self.num_kv_heads is not None and self.num_kv_heads != key.shape[lay.heads]:
            raise ValueError(
                f"DistributedAttention: num_kv_heads={self.num_kv_heads} but the key has "
                f"{key.shape[lay.heads]} heads (dim {lay.heads}); pass the key's head count or None")
        key, value = _replicate_kv(query, key, value, lay.heads, n)
        q, k, v = self._heads_to_sequence(query, key, value, lay, n)
        if rotary_pos_emb is not None:
            cos, sin = (t.transpose(0, 1) for t in rotary_pos_emb)  # DeepSpeed's permute(1, 0, 2, 3)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.local_attn is None:
            out = _sdpa_in_layout(q, k, v, lay, self.causal, self.scale, *args, **kwargs)
        else:
            out = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(out, self.spg, scatter_dim=lay.seq, gather_dim=lay.heads)

    def _heads_to_sequence(self, q, k, v, lay: _Layout, n: int) -> tuple[torch.Tensor, ...]:
        """One exchange for q, k, v, unless the caller's attention needs contiguous tensors
        that separate exchanges give without a copy (Note [Ulysses communication volume])."""
        same = k.shape == v.shape and all(a == b for i, (a, b) in enumerate(zip(q.shape, k.shape)) if i != lay.heads)
        if not same or (self.local_attn is not None and any(_gather_is_view(t, lay, n) for t in (q, k))):
            return tuple(seq_all_to_all(t, self.spg, lay.heads, lay.seq) for t in (q, k, v))
        # SDPA takes strided views; a caller's attention gets contiguous tensors
        return seq_all_to_all_many((q, k, v), self.spg, lay.heads, lay.seq, contiguous=self.local_attn is not None)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    *,
    causal: bool = True,
    scale: float | None = None,
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Ulysses attention for models written in SDPA's layout: q [b, h, s/P, d], k and v
    [b, h_kv, s/P, d] (grouped-query: Note [grouped-query heads]), this rank's contiguous
    slice of the sequence; returns [b, h, s/P, d]. `attention(q, k, v)` on contiguous
    [b, h/P, S, d] replaces the default, SDPA with `is_causal=causal`, `scale` and GQA."""
    lay = _layout(q, scatter_idx=1, gather_idx=2, batch_dim_idx=None)
    n = comm.get_world_size(group)
    k, v = _replicate_kv(q, k, v, 1, n)
    if k.shape == v.shape and q.shape[2:] == k.shape[2:] and q.shape[0] == k.shape[0]:
        q, k, v = seq_all_to_all_many((q, k, v), group, 1, 2, contiguous=attention is not None)
    else:
        q, k, v = (seq_all_to_all(t, group, 1, 2) for t in (q, k, v))
    if attention is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    else:
        out = attention(q, k, v)
    return seq_all_to_all(out, group, scatter_dim=lay.seq, gather_dim=lay.heads)


# -- layout, heads, rotary -------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Which of dims 0..2 hold batch, sequence and heads (head_dim is dim 3)."""

    batch: int
    seq: int
    heads: int


def _layout(q: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int | None) -> _Layout:
    """Note [DeepSpeed's layouts]."""
    if q.dim() != 4:
        raise ValueError(
            f"Ulysses attention expects 4-d query, key and value (batch, sequence, heads in "
            f"some order, head_dim last), got a query of shape {tuple(q.shape)}")
    heads = scatter_idx
    if batch_dim_idx is None:
        if gather_idx not in (0, 1, 2) or gather_idx == heads:
            raise ValueError(
                f"gather_idx={gather_idx} must be the sequence dimension: one of 0, 1, 2 other "
                f"than the heads' {heads}")
        seq = gather_idx
        (batch,) = {0, 1, 2} - {heads, seq}
    else:
        if batch_dim_idx not in (0, 1, 2) or batch_dim_idx == heads:
            raise ValueError(
                f"batch_dim_idx={batch_dim_idx} must be one of 0, 1, 2 other than the heads' "
                f"dimension {heads}; for a query of shape {tuple(q.shape)}")
        batch = batch_dim_idx
        (seq,) = {0, 1, 2} - {heads, batch}
    return _Layout(batch=batch, seq=seq, heads=heads)


def _replicate_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dim: int, n: int):
    """k, v ready to be split over n ranks along `dim` (Note [grouped-query heads])."""
    h, h_kv = q.shape[dim], k.shape[dim]
    if v.shape[dim] != h_kv:
        raise ValueError(f"the key has {h_kv} heads and the value {v.shape[dim]}; they must match")
    if h % n:
        raise ValueError(
            f"{h} query heads cannot be split over a sequence-parallel degree of {n}: the "
            f"number of query heads must be a multiple of {n}")
    if h % h_kv:
        raise ValueError(
            f"{h} query heads cannot share {h_kv} key/value heads: grouped-query attention "
            f"needs the query heads to be a multiple of the key/value heads")
    if h_kv % n == 0:
        return k, v
    if n % h_kv:
        works = ", ".join(str(m) for m in range(1, n + 1) if n % m == 0)
        raise ValueError(
            f"{h_kv} key/value heads cannot be split over a sequence-parallel degree of {n}: "
            f"use a multiple of {n} key/value heads, or a divisor of it ({works})")
    return k.repeat_interleave(n // h_kv, dim=dim), v.repeat_interleave(n // h_kv, dim=dim)


def _gather_is_view(t: torch.Tensor, lay: _Layout, n: int) -> bool:
    """Whether gathering `t`'s sequence after the exchange is a view of the receive buffer
    (only size-1 dimensions before it; Note [one buffer, rank-major] in comm/along.py)."""
    sizes = [t.shape[i] // n if i == lay.heads else t.shape[i] for i in range(lay.seq)]
    return all(size == 1 for size in sizes)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] features of each head (halves rotated:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin))."""
    rot = cos.shape[-1]
    head, tail = t[..., :rot], t[..., rot:]
    try:
        fits = torch.broadcast_shapes(cos.shape, sin.shape, head.shape) == head.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"rotary_pos_emb of shape {tuple(cos.shape)} (dims 0 and 1 swapped, as DeepSpeed "
            f"does) does not broadcast to the gathered query {tuple(head.shape)}; pass "
            f"[S, 1, 1, rot] for batch-first q, [1, S, 1, rot] for [s, b, h, d]")
    x1, x2 = head.chunk(2, dim=-1)
    out = head * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if tail.shape[-1] == 0 else torch.cat((out, tail), dim=-1)


def _sdpa_in_layout(q, k, v, lay: _Layout, causal: bool, scale: float | None, *args, **kwargs):
    """The default local attention: SDPA on [b, h, S, d] views of the layout's tensors."""
    order = (lay.batch, lay.heads, lay.seq, 3)
    q, k, v = (t.permute(order) for t in (q, k, v))
    options = {"is_causal": causal, "scale": scale, "enable_gqa": k.shape[1] != q.shape[1], **kwargs}
    out = F.scaled_dot_product_attention(q, k, v, *args, **options)
    back = sorted(range(4), key=order.__getitem__)  # the inverse permutation
    return out.permute(back)

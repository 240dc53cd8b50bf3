"""The linear layers' autograd Functions, with communication overlapped with the GEMMs.

Note [overlapping tensor-parallel communication]
Tensor-parallel communication sits on the critical path: a sequence-parallel column
layer cannot multiply before its input is gathered, a row layer's output is not usable
before it is reduced. With `overlap_chunks = k > 1` the layers cut that dependency along
the sequence (as in Megatron-LM's and TransformerEngine's comm/GEMM overlap, written here
from the idea, not their code):
* column, sequence parallel, forward: the local shard is cut into k sub-chunks along the
  sequence and all k all-gathers are launched async at once; the GEMM on gathered chunk c
  runs while chunks c+1.. are in flight. Chunk c of every rank holds sequence positions
  {r*T/t + c*T/(t k) + j}, so its output rows are written to those places.
* row, forward: the GEMM is cut the same way (the view (t, k, T/(t k)) of the sequence),
  each chunk's reduce-scatter (sequence parallel) or all-reduce (plain) is launched async
  as soon as its GEMM is done; rank r's output is the concatenation of its pieces.
* row, sequence parallel, backward: the output gradient's k all-gathers are launched at
  once and the input-gradient GEMM of chunk c overlaps chunks c+1..; the weight gradient
  is one GEMM on the assembled gradient (so it is bitwise that of the unchunked path).
* column, backward (both modes): the input gradient is computed first and its
  reduce-scatter (SP) or all-reduce (plain) is launched async, then the weight-gradient
  GEMM runs while it is in flight; in SP the re-gather of the saved input shard (below)
  is launched before the input-gradient GEMM, so that GEMM hides it.
Not overlapped: the all-reduces inside the vocab-parallel cross-entropy and embedding, a
column layer fed by a SharedGather (its gather is shared, not chunked), and anything at
k = 1, which waits for every collective at once (the baseline for BlockedTimer).
Numerics: the chunked forwards compute the same dot products over row subsets of the
GEMM; BLAS may block rows differently, so results agree to fp32 reassociation (the tests
use rtol 1e-5) rather than bit for bit; the reductions' order over ranks is unchanged.

Note [sequence-parallel column layers save the shard]
Sequence parallelism (arXiv:2205.05198, section 4.2.2) keeps only this rank's sequence
shard of a column layer's input for backward and all-gathers it again there: the saved
activation is 1/t of the gathered one, for one more all-gather per layer in backward (the
overlap above hides it). `save_gathered_input=True` saves the gathered input instead:
t times the memory, no re-gather (then SP moves exactly the bytes of plain TP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from meshspeed.comm import collectives
from meshspeed.comm.along import all_reduce_pending, gather_along, reduce_scatter_along


def matmul(x: torch.Tensor, w: torch.Tensor, layout: str) -> torch.Tensor:
    """x @ W^T for nn.Linear's (out, in) weight, x @ W for Conv1D's (in, out)."""
    return F.linear(x, w) if layout == "out_in" else x @ w


def _grad_input(g: torch.Tensor, w: torch.Tensor, layout: str) -> torch.Tensor:
    return g @ w if layout == "out_in" else g @ w.t()


def _grad_weight(g: torch.Tensor, x: torch.Tensor, layout: str) -> torch.Tensor:
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    return g2.t() @ x2 if layout == "out_in" else x2.t() @ g2


def _seq_chunks(x: torch.Tensor, dim: int, k: int) -> tuple[torch.Tensor, ...]:
    if x.shape[dim] % k:
        raise ValueError(f"overlap_chunks={k} does not divide the local sequence length "
                         f"{x.shape[dim]} (dim {dim})")
    return x.chunk(k, dim)


class ColumnLinearFn(torch.autograd.Function):
    """y = x W (+ b) on this rank's output features. mode: "copy" (x replicated: the
    backward all-reduces the input gradient, Megatron's f), "gather" (x a sequence shard:
    all-gathered forward, input gradient reduce-scattered backward), "local" (x already
    gathered by a SharedGather, no communication)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group: Any, mode: str, seq_dim: int, chunks: int,
                save_full: bool, layout: str):
        ctx.group, ctx.mode, ctx.layout, ctx.has_bias = group, mode, layout, bias is not None
        ctx.seq_dim, ctx.overlap = seq_dim % x.dim(), chunks > 1
        if mode != "gather":
            out = matmul(x, weight, layout)
            ctx.save_for_backward(x, weight)
            ctx.saved_full = True
        elif chunks == 1:
            full = gather_along(x, group, seq_dim).wait()
            out = matmul(full, weight, layout)
            ctx.save_for_backward(full if save_full else x, weight)
            ctx.saved_full = save_full
        else:
            (out,), full = gather_gemms_chunked(x, [weight], group, ctx.seq_dim, chunks, [layout],
                                                save_full)
            ctx.save_for_backward(full if save_full else x, weight)
            ctx.saved_full = save_full
        if bias is not None:
            out = out + bias
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        group, layout, overlap = ctx.group, ctx.layout, ctx.overlap
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        regather = None
        if ctx.mode == "gather" and not ctx.saved_full:  # Note [sequence-parallel column layers save the shard]
            regather = gather_along(x, group, ctx.seq_dim, async_op=overlap)
        gx = pending = None
        if need_x:
            gx = _grad_input(g, weight, layout)
            if ctx.mode == "copy":
                pending = all_reduce_pending(gx, group, async_op=overlap)
            elif ctx.mode == "gather":
                pending = reduce_scatter_along(gx, group, ctx.seq_dim, async_op=overlap)
        full = regather.wait() if regather is not None else x
        gw = _grad_weight(g, full, layout) if need_w else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if need_b and ctx.has_bias else None
        if pending is not None:
            gx = pending.wait()
        return gx if need_x else None, gw, gb, None, None, None, None, None, None


def gather_gemms_chunked(x, weights, group, dim: int, k: int, layouts, keep_input: bool):
    """Forward of sequence-parallel column GEMMs in k chunks (Note [overlapping
    tensor-parallel communication]): the chunked all-gather of `x` under the GEMMs of every
    weight in `weights` (one for a column layer, several for siblings sharing the gather):
    ([output per weight], the gathered input if keep_input else None)."""
    t = collectives.get_world_size(group)
    pending = [gather_along(c, group, dim, async_op=True) for c in _seq_chunks(x, dim, k)]
    outs, full = [None] * len(weights), None
    tc = x.shape[dim] // k
    for c, p in enumerate(pending):
        gathered = p.wait()  # (.., t * tc, ..): sequence positions (r, c, j)
        if keep_input and full is None:
            shape = list(gathered.shape)
            shape[dim] *= k
            full = x.new_empty(shape)
        for i, (weight, layout) in enumerate(zip(weights, layouts)):
            part = matmul(gathered, weight, layout)
            if outs[i] is None:
                shape = list(part.shape)
                shape[dim] *= k
                outs[i] = part.new_empty(shape)
            outs[i].unflatten(dim, (t, k, tc)).select(dim + 1, c).copy_(part.unflatten(dim, (t, tc)))
        if full is not None:
            full.unflatten(dim, (t, k, tc)).select(dim + 1, c).copy_(gathered.unflatten(dim, (t, tc)))
    return outs, full


class RowLinearChunkedFn(torch.autograd.Function):
    """x W on this rank's input features, reduced over the group in k sequence chunks
    whose collectives overlap the next chunk's GEMM. mode: "reduce" (all-reduce, output
    replicated) or "scatter" (reduce-scatter along seq_dim, output a sequence shard)."""

    @staticmethod
    def forward(ctx, x, weight, group: Any, mode: str, seq_dim: int, chunks: int, layout: str):
        dim = seq_dim % x.dim()
        ctx.group, ctx.mode, ctx.seq_dim, ctx.chunks, ctx.layout = group, mode, dim, chunks, layout
        ctx.save_for_backward(x, weight)
        t = collectives.get_world_size(group)
        if mode == "reduce":
            pending = [all_reduce_pending(matmul(c, weight, layout), group, async_op=True)
                       for c in _seq_chunks(x, dim, chunks)]
        else:
            if x.shape[dim] % (t * chunks):
                raise ValueError(f"sequence length {x.shape[dim]} does not split into {t} ranks x "
                                 f"{chunks} chunks")
            view = x.unflatten(dim, (t, chunks, x.shape[dim] // (t * chunks)))
            pending = [reduce_scatter_along(matmul(view.select(dim + 1, c).flatten(dim, dim + 1),
                                                   weight, layout), group, dim, async_op=True)
                       for c in range(chunks)]
        return torch.cat([p.wait() for p in pending], dim)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dim, k, layout = ctx.seq_dim, ctx.chunks, ctx.layout
        if ctx.mode == "reduce":
            full = g
            gx = _grad_input(g, weight, layout) if ctx.needs_input_grad[0] else None
        else:
            t = collectives.get_world_size(ctx.group)
            pending = [gather_along(c, ctx.group, dim, async_op=True) for c in _seq_chunks(g, dim, k)]
            shape = list(g.shape)
            shape[dim] *= t
            full = g.new_empty(shape)
            gx = x.new_empty((*shape[:-1], x.shape[-1])) if ctx.needs_input_grad[0] else None
            tc = g.shape[dim] // k
            for c, p in enumerate(pending):
                part = p.wait()  # positions (r, c, j)
                full.unflatten(dim, (t, k, tc)).select(dim + 1, c).copy_(part.unflatten(dim, (t, tc)))
                if gx is not None:
                    gx.unflatten(dim, (t, k, tc)).select(dim + 1, c).copy_(
                        _grad_input(part, weight, layout).unflatten(dim, (t, tc)))
        gw = _grad_weight(full, x, layout) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None, None

"""Collectives along any dimension of a tensor, with results that arrive on `wait()`.

`all_gather_into_tensor` and `reduce_scatter_tensor` work on dim 0. Activations are
batch-first (B, T, d), so sequence parallelism gathers and scatters along dim 1: the
helpers here move the rank axis to where it belongs. Each returns a `Pending` whose
`wait()` gives the result tensor; with `async_op=False` it is already complete.
`all_to_all_along` (DeepSpeed-Ulysses' exchange, and with dims 0 MoE's) returns its
results directly.

Note [one buffer, rank-major]
`all_to_all_single` sends dim-0 chunk j of one contiguous buffer to rank j. So the send
buffer is x viewed as (N, ..., x_s/N, ...) with the rank axis moved to the front: one copy,
none when that view is already contiguous (x scattered along its outermost dimension, as
the attention output in the [s, b, h, d] layout is). The receive buffer has the same shape,
chunk j from rank j; moving its rank axis to just before `gather_dim` and merging the two
is a view when only size-1 dimensions precede `gather_dim` (the sequence of [s, b, h, d],
or of [b, s, h, d] at b = 1), else one copy. So an exchange copies once on each side at
most. (A size-1 dimension elsewhere can make the merge a strided view; the caller that
needs a contiguous result makes it so.)

Where the send side copies anyway and the receiver takes strided tensors (the default
attention: SDPA reads any strides), that copy can put each chunk's gathered dimension
first, (N, x_g, rest...): the receive buffer then merges (N, x_g) as a view in every
layout, and the result is a permuted view with no copy on the receive side. That is the
ordering of `views=True` (`seq_all_to_all_many(..., contiguous=False)` and every
backward); `views=False` keeps the natural order, whose merge is the copy that makes the
result contiguous. The backward of an exchange is the exchange with the two dimensions
swapped (meshspeed/comm/differentiable.py), free to choose its own send ordering: so each
direction copies once, where a backward derived by autograd from the forward's ordering
would copy twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshspeed.comm import collectives


class Pending:
    """The result of a collective, available after `wait()` (which may be called more
    than once; the finishing step runs once)."""

    def __init__(self, work: Any, finish: Callable[[], torch.Tensor]) -> None:
        self._work, self._finish = work, finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._work = self._finish = None
        return self._result


def gather_along(x: torch.Tensor, group: Any, dim: int, async_op: bool = False) -> Pending:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    n = collectives.get_world_size(group)
    dim = dim % x.dim()
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # torch wants the rank axis folded into dim 0
    work = collectives.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    if dim == 0:
        return Pending(work, lambda: out)
    # (n, ..., x_dim, ...) -> (..., n, x_dim, ...) -> (..., n * x_dim, ...)
    return Pending(work, lambda: out.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1))


def reduce_scatter_along(x: torch.Tensor, group: Any, dim: int, async_op: bool = False) -> Pending:
    """Sum `x` over the ranks; rank r keeps the r-th of N equal pieces along `dim`."""
    n = collectives.get_world_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter along dim {dim}: size {x.shape[dim]} does not divide "
                         f"over {n} ranks")
    if dim == 0:
        stacked = x.contiguous()
    else:  # (..., n * s, ...) -> (n, ..., s, ...), folded into dim 0 as torch wants
        stacked = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous().flatten(0, 1)
    out = x.new_empty((stacked.shape[0] // n, *stacked.shape[1:]))
    work = collectives.reduce_scatter_tensor(out, stacked, group=group, async_op=async_op)
    return Pending(work, lambda: out)


def all_reduce_pending(x: torch.Tensor, group: Any, async_op: bool = False) -> Pending:
    """Sum `x` over the ranks, in place (x must not be a view that others read meanwhile)."""
    work = collectives.all_reduce(x, group=group, async_op=async_op)
    return Pending(work, lambda: x)


def split_along(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's piece of `x`, cut into N equal pieces along `dim` (no communication)."""
    n, rank = collectives.get_world_size(group), collectives.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"split along dim {dim}: size {x.shape[dim]} does not divide over {n} ranks")
    return x.chunk(n, dim)[rank].contiguous()


def all_to_all_along(xs: Sequence[torch.Tensor], group: Any, scatter_dim: int, gather_dim: int,
                     cat_dim: int, views: bool) -> list[torch.Tensor]:
    """One all-to-all for all of `xs`: each x is cut into N equal pieces along `scatter_dim`,
    piece j going to rank j; what arrives from ranks 0..N-1 is concatenated, in rank order,
    along `gather_dim`. The tensors share the collective by concatenating their pieces
    along `cat_dim` inside each rank's chunk, so they must agree elsewhere. `views`: results
    may be permuted views (Note [one buffer, rank-major])."""
    n = collectives.get_world_size(group)
    ndim = xs[0].dim()
    s, g, c = _dim(scatter_dim, ndim), _dim(gather_dim, ndim), _dim(cat_dim, ndim)
    for x in xs:
        if x.shape[s] % n:
            raise ValueError(
                f"all-to-all over {n} ranks cannot split dim {s} of size {x.shape[s]} (shape "
                f"{tuple(x.shape)}) evenly; its size must be a multiple of {n}")
    # (..., x_s, ...) -> (N, ..., x_s / N, ...): chunk j goes to rank j
    pieces = [x.unflatten(s, (n, x.shape[s] // n)).movedim(s, 0) for x in xs]
    natural_is_free = (len(xs) == 1 and pieces[0].is_contiguous()) or all(d == 1 for d in pieces[0].shape[1:g + 1])
    if views and (c != g or len(xs) == 1) and not natural_is_free:  # chunks (N, x_g, rest): merge is a view
        order = (0, g + 1, *(i for i in range(1, ndim + 1) if i != g + 1))
        pieces = [p.permute(order) for p in pieces]
        cat = order.index(c + 1)

        def merge(part: torch.Tensor) -> torch.Tensor:
            return part.flatten(0, 1).movedim(0, g)
    else:  # (N, ..., x_g, ...) -> (..., N, x_g, ...) -> (..., N * x_g, ...)
        cat = c + 1

        def merge(part: torch.Tensor) -> torch.Tensor:
            return part.movedim(0, g).flatten(g, g + 1)
    sizes = [p.shape[cat] for p in pieces]
    if len(pieces) == 1:
        send = pieces[0].contiguous()
    else:
        shape = list(pieces[0].shape)
        shape[cat] = sum(sizes)
        send = pieces[0].new_empty(shape)
        for piece, part in zip(pieces, send.split(sizes, dim=cat), strict=True):
            part.copy_(piece)
    recv = torch.empty_like(send)
    collectives.all_to_all_single(recv, send, group=group)
    return [merge(part) for part in recv.split(sizes, dim=cat)]  # rank order is global order


def _dim(d: int, ndim: int) -> int:
    if not -ndim <= d < ndim:
        raise ValueError(f"all-to-all dimension {d} is out of range for a {ndim}-d tensor")
    return d % ndim

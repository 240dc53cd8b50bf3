"""The differentiable all-to-all DeepSpeed-Ulysses is built on (arXiv:2309.14509, section 3).

    seq_all_to_all(x, group, scatter_dim, gather_dim)          one tensor, contiguous result
    seq_all_to_all_many(xs, group, scatter_dim, gather_dim)     several, sharing collectives

Rank r cuts `x` into N equal pieces along `scatter_dim` and sends piece j to rank j; what
arrives from ranks 0..N-1 is concatenated, in rank order, along `gather_dim`. With x the
rank's tokens of every head, (scatter heads, gather sequence) gives every token of the
rank's heads; (scatter sequence, gather heads) turns that back.

The operation only moves elements between ranks: it is a permutation of the distributed
tensor, and its adjoint is the inverse permutation, which is the same all-to-all with the
two dimensions swapped. That is the backward (the gradient of every element goes back to
where the element came from); nothing is summed.

Note [one buffer, rank-major]
`all_to_all_single` sends dim-0 chunk j of one contiguous buffer to rank j. So the send
buffer is x viewed as (N, ..., x_s/N, ...) with the rank axis moved to the front: one copy,
none when that view is already contiguous (x scattered along its outermost dimension, as
the attention output in the [s, b, h, d] layout is). The receive buffer has the same shape,
chunk j from rank j; moving its rank axis to just before `gather_dim` and merging the two
is a view when only size-1 dimensions precede `gather_dim` (the sequence of [s, b, h, d],
or of [b, s, h, d] at b = 1), else one copy. So an exchange copies once on each side at
most. (A size-1 dimension elsewhere can make the merge a strided view; `seq_all_to_all`
makes that contiguous, so its result always is.)

Where the send side copies anyway and the receiver takes strided tensors (the default
attention: SDPA reads any strides), that copy can put each chunk's gathered dimension
first, (N, x_g, rest...): the receive buffer then merges (N, x_g) as a view in every
layout, and the result is a permuted view with no copy on the receive side. That is the
ordering of `seq_all_to_all_many(..., contiguous=False)` and of the backward;
`seq_all_to_all` and `contiguous=True` keep the natural order, whose merge is the copy
that makes the result contiguous.

Note [buckets]
Several tensors (q, k and v) share a collective by concatenating their pieces along
`scatter_dim` inside each rank's chunk, (N, ..., sum_i x_s_i/N, ...): they may differ
along `scatter_dim` (grouped-query k/v have fewer heads) and must agree elsewhere. One
collective instead of three saves two launch latencies (about 1 ms each on gloo here) for
the same bytes and the same send copies. But on CPU a shared buffer is a larger
allocation, and glibc serves allocations above its mmap threshold (at most 32 MiB) with
fresh pages every call: at 16 MiB per tensor the page faults of one 48 MiB buffer cost
more than the two launches (measured on gloo, P = 2: 205 ms against 121 ms for three
exchanges; at 1 MiB per tensor 7.7 ms against 10.3 ms). So CPU tensors are grouped, in
order, into collectives of at most CPU_BUCKET_BYTES of input; on other devices (CUDA's
caching allocator reuses its blocks) all of them go in one. In the backward each bucket's
gradients go back the same way, in one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshspeed import comm

CPU_BUCKET_BYTES = 8 * 2**20  # Note [buckets]


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` into N pieces (N = size of `group`), piece j to rank j;
    concatenate what arrives along `gather_dim` in rank order. Differentiable (backward:
    the same with the dimensions swapped). The result is contiguous (Note [one buffer,
    rank-major])."""
    # .contiguous(): a no-op but where a size-1 dimension lets the merge be a strided view
    return _AllToAll.apply(group, scatter_dim, gather_dim, False, x)[0].contiguous()


def seq_all_to_all_many(
    xs: Sequence[torch.Tensor], group: Any, scatter_dim: int, gather_dim: int, *, contiguous: bool = False
) -> tuple[torch.Tensor, ...]:
    """`seq_all_to_all` of each tensor of `xs`, sharing collectives (Note [buckets]). The
    tensors must have the same shape except along `scatter_dim`. Results are strided views
    where that saves a copy, or with `contiguous=True` contiguous (Note [one buffer,
    rank-major])."""
    if not xs:
        raise ValueError("seq_all_to_all_many needs at least one tensor, got none")
    _check_shapes(xs, _dim(scatter_dim, xs[0].dim()))
    outs = [out for bucket in _buckets(xs) for out in _AllToAll.apply(group, scatter_dim, gather_dim,
                                                                       not contiguous, *bucket)]
    return tuple(t.contiguous() for t in outs) if contiguous else tuple(outs)


class _AllToAll(torch.autograd.Function):
    """One collective for `xs`, concatenated in each rank's chunk along the forward's
    `scatter_dim`, both ways."""

    @staticmethod
    def forward(ctx, group: Any, scatter_dim: int, gather_dim: int, views: bool, *xs: torch.Tensor):
        ctx.backward_args = (group, gather_dim, scatter_dim, scatter_dim, True)
        return tuple(_exchange(xs, group, scatter_dim, gather_dim, scatter_dim, views))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, None, None, *_exchange(grads, *ctx.backward_args))


def _exchange(
    xs: Sequence[torch.Tensor], group: Any, scatter_dim: int, gather_dim: int, cat_dim: int, views: bool
) -> list[torch.Tensor]:
    """The all-to-all itself (no autograd), the tensors concatenated along `cat_dim` in
    each chunk; `views`: results may be permuted views (Note [one buffer, rank-major])."""
    n = comm.get_world_size(group)
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
    comm.all_to_all_single(recv, send, group=group)
    return [merge(part) for part in recv.split(sizes, dim=cat)]  # rank order is global order


def _buckets(xs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive groups of `xs`, one collective each (Note [buckets])."""
    if xs[0].device.type != "cpu":
        return [list(xs)]
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for x in xs:
        nbytes = x.numel() * x.element_size()
        if buckets and size + nbytes <= CPU_BUCKET_BYTES:
            buckets[-1].append(x)
            size += nbytes
        else:
            buckets.append([x])
            size = nbytes
    return buckets


def _dim(d: int, ndim: int) -> int:
    if not -ndim <= d < ndim:
        raise ValueError(f"all-to-all dimension {d} is out of range for a {ndim}-d tensor")
    return d % ndim


def _check_shapes(xs: Sequence[torch.Tensor], c: int) -> None:
    first = xs[0].shape
    for x in xs:
        if x.dim() != len(first) or any(a != b for i, (a, b) in enumerate(zip(x.shape, first)) if i != c):
            raise ValueError(
                f"tensors sent in one all-to-all must agree except along dim {c}, got shapes "
                f"{tuple(first)} and {tuple(x.shape)}; send them in separate calls")

"""The differentiable all-to-all DeepSpeed-Ulysses is built on (arXiv:2309.14509, section 3).

    seq_all_to_all(x, group, scatter_dim, gather_dim)          one tensor
    seq_all_to_all_many(xs, group, scatter_dim, gather_dim)     several, in one collective

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
none when that view is already contiguous (x scattered along its outermost dimension,
as the output of attention in the [s, b, h, d] layout is). The receive buffer has the same
shape, with chunk j from rank j; moving its rank axis to just before `gather_dim` and
merging the two is a view when only size-1 dimensions precede `gather_dim` (the sequence
of [s, b, h, d], or of [b, s, h, d] at b = 1) and one copy otherwise. So one exchange is
one copy on each side at most. (A size-1 gathered or neighbouring dimension can make the
merge a strided view too; `seq_all_to_all` makes that contiguous, so its result always
is.)

Several tensors (q, k and v) go in one collective by concatenating their pieces along
`scatter_dim` inside each rank's chunk: the buffer is (N, ..., sum_i x_s_i/N, ...), so
the tensors may differ along `scatter_dim` (grouped-query k/v have fewer heads) and must
agree everywhere else. One collective instead of three saves two launch latencies and
costs the same copies on the send side. On the receive side, where the merge is a view,
each result is a view of the shared buffer (narrow along `scatter_dim`): not contiguous,
which attention kernels accept but `.view()` does not; elsewhere each result is its own
contiguous copy. In the backward the gradients travel the same way, in one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshspeed import comm


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` into N pieces (N = size of `group`), piece j to rank j;
    concatenate what arrives along `gather_dim` in rank order. Differentiable (backward:
    the same with the dimensions swapped). The result is contiguous (Note [one buffer,
    rank-major])."""
    # .contiguous(): a no-op but where a size-1 dimension lets the merge be a strided view
    return _AllToAll.apply(group, scatter_dim, gather_dim, scatter_dim, x)[0].contiguous()


def seq_all_to_all_many(
    xs: Sequence[torch.Tensor], group: Any, scatter_dim: int, gather_dim: int
) -> tuple[torch.Tensor, ...]:
    """`seq_all_to_all` of each tensor of `xs`, in one collective. The tensors must have
    the same shape except along `scatter_dim`. Results are views of one buffer where the
    gathered dimension is outermost, else contiguous copies (Note [one buffer,
    rank-major])."""
    if not xs:
        raise ValueError("seq_all_to_all_many needs at least one tensor, got none")
    return _AllToAll.apply(group, scatter_dim, gather_dim, scatter_dim, *xs)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Any, scatter_dim: int, gather_dim: int, cat_dim: int, *xs: torch.Tensor):
        ctx.swapped = (group, gather_dim, scatter_dim, cat_dim)
        return tuple(_exchange(xs, group, scatter_dim, gather_dim, cat_dim))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, None, None, *_exchange(grads, *ctx.swapped))


def _exchange(
    xs: Sequence[torch.Tensor], group: Any, scatter_dim: int, gather_dim: int, cat_dim: int
) -> list[torch.Tensor]:
    """The all-to-all itself (no autograd); the tensors share one buffer, concatenated
    along `cat_dim` inside each rank's chunk (the dimension along which they may differ)."""
    n = comm.get_world_size(group)
    ndim = xs[0].dim()
    s, g, c = _dim(scatter_dim, ndim), _dim(gather_dim, ndim), _dim(cat_dim, ndim)
    _check_shapes(xs, c, s, n)
    # (..., x_s, ...) -> (N, ..., x_s / N, ...): chunk j goes to rank j
    pieces = [x.unflatten(s, (n, x.shape[s] // n)).movedim(s, 0) for x in xs]
    sizes = [p.shape[c + 1] for p in pieces]
    if len(pieces) == 1:
        send = pieces[0].contiguous()
    else:
        shape = list(pieces[0].shape)
        shape[c + 1] = sum(sizes)
        send = pieces[0].new_empty(shape)
        for piece, part in zip(pieces, send.split(sizes, dim=c + 1), strict=True):
            part.copy_(piece)
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    # (N, ..., x_g, ...) -> (..., N, x_g, ...) -> (..., N * x_g, ...): rank order is global order
    return [part.movedim(0, g).flatten(g, g + 1) for part in recv.split(sizes, dim=c + 1)]


def _dim(d: int, ndim: int) -> int:
    if not -ndim <= d < ndim:
        raise ValueError(f"all-to-all dimension {d} is out of range for a {ndim}-d tensor")
    return d % ndim


def _check_shapes(xs: Sequence[torch.Tensor], c: int, s: int, n: int) -> None:
    first = xs[0].shape
    for x in xs:
        if x.dim() != len(first) or any(a != b for i, (a, b) in enumerate(zip(x.shape, first)) if i != c):
            raise ValueError(
                f"tensors sent in one all-to-all must agree except along dim {c}, got shapes "
                f"{tuple(first)} and {tuple(x.shape)}; send them in separate calls")
        if x.shape[s] % n:
            raise ValueError(
                f"all-to-all over {n} ranks cannot split dim {s} of size {x.shape[s]} (shape "
                f"{tuple(x.shape)}) evenly; its size must be a multiple of {n}")

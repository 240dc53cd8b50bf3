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

The exchange itself is `meshspeed.comm.differentiable.all_to_all_many` (one send buffer
and at most one copy on each side, Note [one buffer, rank-major] in comm/along.py); this
module adds the bucketing and the contiguity each caller asks for.

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

from meshspeed.comm.differentiable import all_to_all_many

CPU_BUCKET_BYTES = 8 * 2**20  # Note [buckets]


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` into N pieces (N = size of `group`), piece j to rank j;
    concatenate what arrives along `gather_dim` in rank order. Differentiable (backward:
    the same with the dimensions swapped). The result is contiguous (Note [one buffer,
    rank-major])."""
    # .contiguous(): a no-op but where a size-1 dimension lets the merge be a strided view
    return all_to_all_many((x,), group, scatter_dim, gather_dim)[0].contiguous()


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
    outs = [out for bucket in _buckets(xs)
            for out in all_to_all_many(bucket, group, scatter_dim, gather_dim, views=not contiguous)]
    return tuple(t.contiguous() for t in outs) if contiguous else tuple(outs)


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

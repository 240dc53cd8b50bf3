"""Differentiable collectives: named forward/backward pairs (autograd Functions).

Megatron-LM (arXiv:1909.08053, section 3) writes tensor parallelism with two conjugate
operators, "f" (identity forward, all-reduce backward) and "g" (all-reduce forward,
identity backward); sequence parallelism (arXiv:2205.05198, section 4.2.2) replaces them
by all-gather / reduce-scatter along the sequence dimension.

    pair                        forward                    backward
    copy_to_parallel            identity                   all-reduce (sum)       "f"
    reduce_from_parallel        all-reduce (sum)           identity               "g"
    all_gather_sequence         all-gather along dim       reduce-scatter along dim
    reduce_scatter_sequence     reduce-scatter along dim   all-gather along dim
    scatter_to_parallel         keep this rank's piece     all-gather along dim
    gather_from_parallel        all-gather along dim       keep this rank's piece
    all_to_all                  all-to-all of dim-0        all-to-all, split sizes swapped
                                blocks (split sizes
                                optional)
    all_to_all_many             all-to-all, scatter one    all-to-all, the two dims swapped
                                dim, gather another

`all_to_all` is expert parallelism's token exchange (GShard, arXiv:2006.16668; DeepSpeed-MoE,
arXiv:2201.05596), `all_to_all_many` DeepSpeed-Ulysses' head/sequence exchange
(arXiv:2309.14509, section 3); both are one autograd Function, `_AllToAll`.

Note [what the backward of a collective means]
Each pair is the derivative of one objective: the sum over the ranks of their losses,
where a replicated tensor counts once (every rank holds the same loss on it). So where a
forward sends a replicated value into per-rank computations (copy, gather), the backward
sums the per-rank gradients; where the forward sums partial values into a replicated or
sharded result (all-reduce, reduce-scatter), the backward hands each rank the gradient of
what it contributed to. The tests in tests/comm/test_differentiable.py check each pair
against autograd of that objective computed whole on one process.

Note [the adjoint of an all-to-all]
An all-to-all only moves elements between ranks: it is a permutation of the distributed
tensor, and its adjoint is the inverse permutation, which is again an all-to-all: the
same one with equal blocks along dim 0, with the split sizes swapped when they are
uneven (rank j sent input_splits[j] rows here and receives them back), with scatter and
gather dimensions swapped along dims. So the backward sums nothing: the gradient of every
element goes back to where the element came from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshspeed.comm.along import all_to_all_along, gather_along, reduce_scatter_along, split_along
from meshspeed.comm.collectives import all_reduce, all_to_all_single, get_world_size


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _gather(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return gather_along(x, group, dim).wait()


def _reduce_scatter(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return reduce_scatter_along(x, group, dim).wait()


def _pair_along(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd Function over (x, group, dim) with the given forward and backward
    collectives along `dim` (the four sequence / split pairs below differ only in those)."""

    def fwd(ctx, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return forward(x, group, dim)

    def bwd(ctx, grad: torch.Tensor):
        return backward(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


#                    name                     forward          backward
_AllGatherSequence = _pair_along("_AllGatherSequence", _gather, _reduce_scatter)
_ReduceScatterSequence = _pair_along("_ReduceScatterSequence", _reduce_scatter, _gather)
_ScatterToParallel = _pair_along("_ScatterToParallel", split_along, _gather)
_GatherFromParallel = _pair_along("_GatherFromParallel", _gather, split_along)


Splits = tuple[list[int], list[int]] | None  # (output_splits, input_splits): rows per rank


def _exchange(xs: Sequence[torch.Tensor], group: Any, scatter_dim: int, gather_dim: int,
              splits: Splits, cat_dim: int, views: bool) -> list[torch.Tensor]:
    """The all-to-all itself, no autograd: uneven dim-0 blocks when `splits` are given, else
    `all_to_all_along`."""
    if splits is None:
        return all_to_all_along(xs, group, scatter_dim, gather_dim, cat_dim, views)
    (x,), (output_splits, input_splits) = xs, splits
    x = x.contiguous()
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    all_to_all_single(out, x, group=group, output_split_sizes=output_splits, input_split_sizes=input_splits)
    return [out]


class _AllToAll(torch.autograd.Function):
    """The exchange of `xs` in one collective; backward: the exchange of their gradients with
    the dimensions and the split sizes swapped, Note [the adjoint of an all-to-all]. The
    backward may return permuted views (its send side copies anyway, Note [one buffer,
    rank-major] in along.py)."""

    @staticmethod
    def forward(ctx, group: Any, scatter_dim: int, gather_dim: int, splits: Splits, views: bool,
                *xs: torch.Tensor):
        swapped = None if splits is None else (splits[1], splits[0])
        ctx.backward_args = (group, gather_dim, scatter_dim, swapped, scatter_dim, True)
        return tuple(_exchange(xs, group, scatter_dim, gather_dim, splits, scatter_dim, views))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, None, None, None, *_exchange(grads, *ctx.backward_args))


def copy_to_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; backward sums the gradient over `group` ("f")."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over `group` forward (a new tensor); identity backward ("g")."""
    return _ReduceFromParallel.apply(x, group)


def all_gather_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Concatenate the ranks' sequence shards along `dim`; backward reduce-scatters."""
    return _AllGatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Sum over `group` and keep this rank's piece along `dim`; backward all-gathers."""
    return _ReduceScatterSequence.apply(x, group, dim)


def scatter_to_parallel(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Keep this rank's piece of a replicated `x` along `dim`; backward all-gathers."""
    return _ScatterToParallel.apply(x, group, dim)


def gather_from_parallel(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' pieces along `dim` (replicated result); backward keeps this
    rank's piece of the gradient."""
    return _GatherFromParallel.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group: Any, output_splits: Sequence[int] | None = None,
               input_splits: Sequence[int] | None = None) -> torch.Tensor:
    """Dim-0 block j of `x` goes to rank j; block r of the result came from rank r. Equal
    blocks without split sizes (dim 0 must divide by the group size); with them, the first
    input_splits[0] rows of x go to rank 0, the next input_splits[1] to rank 1, ..., and
    the result holds output_splits[j] rows from each rank j, in rank order (rows per rank,
    as `torch.distributed.all_to_all_single` takes them; both or neither). Backward: the
    all-to-all of the gradient, split sizes swapped."""
    if (output_splits is None) != (input_splits is None):
        raise ValueError("all_to_all: give both output_splits and input_splits (rows to receive from "
                         "and to send to each rank), or neither for equal blocks")
    splits = None
    if input_splits is not None:
        splits = (list(output_splits), list(input_splits))
        n = get_world_size(group)
        if len(splits[0]) != n or len(splits[1]) != n or sum(splits[1]) != x.shape[0]:
            raise ValueError(f"all_to_all over {n} ranks: output_splits={splits[0]} and input_splits="
                             f"{splits[1]} must have one entry per rank, and input_splits must sum to "
                             f"the {x.shape[0]} rows of x")
    return _AllToAll.apply(group, 0, 0, splits, False, x)[0]


def all_to_all_many(xs: Sequence[torch.Tensor], group: Any, scatter_dim: int, gather_dim: int, *,
                    views: bool = False) -> tuple[torch.Tensor, ...]:
    """Each x of `xs` cut into N equal pieces along `scatter_dim` (N = size of `group`), piece
    j to rank j; what arrives is concatenated along `gather_dim` in rank order. One
    collective for all of them: they must have the same shape except along `scatter_dim`.
    `views=True`: results may be permuted views, saving the receive side's copy (Note [one
    buffer, rank-major] in along.py). Backward: the same exchange with the dims swapped."""
    return _AllToAll.apply(group, scatter_dim, gather_dim, None, views, *xs)

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

Note [what the backward of a collective means]
Each pair is the derivative of one objective: the sum over the ranks of their losses,
where a replicated tensor counts once (every rank holds the same loss on it). So where a
forward sends a replicated value into per-rank computations (copy, gather), the backward
sums the per-rank gradients; where the forward sums partial values into a replicated or
sharded result (all-reduce, reduce-scatter), the backward hands each rank the gradient of
what it contributed to. The tests in tests/comm/test_differentiable.py check each pair
against autograd of that objective computed whole on one process.
"""

from __future__ import annotations

from typing import Any

import torch

from meshspeed.comm.along import gather_along, reduce_scatter_along, split_along
from meshspeed.comm.collectives import all_reduce


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


class _AllGatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather_along(x, group, dim).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_along(grad, ctx.group, ctx.dim).wait(), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, group, dim).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_along(grad, ctx.group, ctx.dim).wait(), None, None


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_along(grad, ctx.group, ctx.dim).wait(), None, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather_along(x, group, dim).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_along(grad, ctx.group, ctx.dim), None, None


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

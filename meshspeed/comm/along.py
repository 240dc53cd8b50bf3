"""Collectives along any dimension of a tensor, with results that arrive on `wait()`.

`all_gather_into_tensor` and `reduce_scatter_tensor` work on dim 0. Activations are
batch-first (B, T, d), so sequence parallelism gathers and scatters along dim 1: the
helpers here move the rank axis to where it belongs. Each returns a `Pending` whose
`wait()` gives the result tensor; with `async_op=False` it is already complete.
"""

from __future__ import annotations

from collections.abc import Callable
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

"""`SharedGather`: sibling column layers that read one input (q/k/v, gate/up) as one node.

Note [one gather for sibling column layers]
In sequence parallelism the q, k and v projections (or a gated MLP's gate and up) each
start from the same sequence shard, and each would all-gather it: t-1/t of the gathered
activation sent three times. Plain tensor parallelism has the same waste in backward:
each sibling's input gradient is a partial sum, and all-reducing each moves the
activation's bytes three times where one all-reduce of their sum would do (torch's
DTensor keeps the three partial and reduces once).
So whoever builds the layers gives the siblings one `SharedGather` and `join`s each to
it. The first sibling called on an input computes every sibling's output in one
autograd node (`SiblingColumnsFn`) and the others, called on the same tensor (same
object and `_version`, so an in-place change in between invalidates it; same grad mode),
take theirs from it. Forward: one all-gather of the shard (SP; chunked under the GEMMs
with overlap) or none (plain). Backward: the siblings' input gradients summed, one
reduce-scatter (SP) or all-reduce (plain), launched asynchronously under the weight-
gradient GEMMs when overlap is on. Cost: the gathered input is saved for the weight
gradients (one tensor, shared) instead of each sibling's shard (Note [sequence-parallel
column layers save the shard]). The input is held weakly and unclaimed outputs are
dropped with it, so nothing outlives a forward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from meshspeed.comm.along import all_reduce_pending, gather_along, reduce_scatter_along
from meshspeed.tensor_parallel.overlap import (
    _grad_input,
    _grad_weight,
    gather_gemms_chunked,
    matmul,
)


class SiblingColumnsFn(torch.autograd.Function):
    """Column GEMMs of several weights on one input. mode: "copy" (x replicated; input
    gradient all-reduced) or "gather" (x a sequence shard, all-gathered; input gradient
    reduce-scattered). params: weight, bias (or an empty tensor), weight, bias, ..."""

    @staticmethod
    def forward(ctx, x, group: Any, mode: str, seq_dim: int, chunks: int, layouts: tuple, *params):
        dim = seq_dim % x.dim()
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.mode, ctx.dim, ctx.layouts = group, mode, dim, layouts
        ctx.overlap, ctx.has_bias = chunks > 1, [b.numel() > 0 for b in biases]
        if mode == "copy":
            full, outs = x, [matmul(x, w, lay) for w, lay in zip(weights, layouts)]
        elif chunks == 1:
            full = gather_along(x, group, dim).wait()
            outs = [matmul(full, w, lay) for w, lay in zip(weights, layouts)]
        else:
            outs, full = gather_gemms_chunked(x, list(weights), group, dim, chunks, layouts, True)
        ctx.save_for_backward(full, *weights)
        return tuple(o + b if has else o for o, b, has in zip(outs, biases, ctx.has_bias))

    @staticmethod
    def backward(ctx, *grads):
        full, *weights = ctx.saved_tensors
        gx = None
        for g, w, lay in zip(grads, weights, ctx.layouts):
            part = _grad_input(g, w, lay)
            gx = part if gx is None else gx.add_(part)
        if ctx.mode == "copy":
            pending = all_reduce_pending(gx, ctx.group, async_op=ctx.overlap)
        else:
            pending = reduce_scatter_along(gx, ctx.group, ctx.dim, async_op=ctx.overlap)
        params = []  # the weight gradients run while the input gradient is in flight
        for g, w, lay, has in zip(grads, weights, ctx.layouts, ctx.has_bias):
            params.append(_grad_weight(g, full, lay))
            params.append(g.reshape(-1, g.shape[-1]).sum(0) if has else None)
        return (pending.wait(), None, None, None, None, None, *params)


class SharedGather:
    def __init__(self, group: Any, seq_dim: int = 1, *, gather: bool = True) -> None:
        self.group, self.seq_dim, self.gather = group, seq_dim, gather
        self.members: list[Any] = []  # the sibling layers, in the order they joined
        self._source: weakref.ref | None = None
        self._key: tuple[int, bool] | None = None
        self._outputs: dict[int, torch.Tensor] = {}
        self.gathers = self.reuses = 0  # for tests and reports

    def join(self, layer: Any) -> None:
        """Add a ColumnParallelLinear to the siblings (and set its `shared_gather`)."""
        if getattr(layer, "gather_output", False):
            raise ValueError("a column layer that gathers its output cannot share its input")
        if all(m is not layer for m in self.members):
            self.members.append(layer)
        layer.shared_gather = self

    def output(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """`layer`'s output for input `x`: computed with its siblings' on first use."""
        if all(m is not layer for m in self.members):
            raise ValueError(f"{type(layer).__name__} uses a SharedGather it has not joined; call "
                             "shared.join(layer) for every sibling (or pass shared_gather= to "
                             "the constructor) before the forward")
        key = (x._version, torch.is_grad_enabled())
        fresh = self._source is None or self._source() is not x or self._key != key
        if fresh or id(layer) not in self._outputs:
            self._compute(x, key)
        else:
            self.reuses += 1
        return self._outputs.pop(id(layer))

    def _compute(self, x: torch.Tensor, key: tuple[int, bool]) -> None:
        lead = self.members[0]
        params = []
        for m in self.members:
            params += [m.weight, m.bias if m.bias is not None else m.weight.new_empty(0)]
        outs = SiblingColumnsFn.apply(x, self.group, "gather" if self.gather else "copy",
                                      self.seq_dim, lead.overlap_chunks,
                                      tuple(m.weight_layout for m in self.members), *params)
        self._source, self._key = weakref.ref(x, self._forget), key
        self._outputs = {id(m): o for m, o in zip(self.members, outs)}
        self.gathers += 1

    def _forget(self, ref: weakref.ref) -> None:
        if self._source is ref:
            self._source, self._key, self._outputs = None, None, {}

"""`SharedGather`: one sequence all-gather for sibling column layers that read one input.

Note [one gather for sibling column layers]
In sequence parallelism the q, k and v projections (or a gated MLP's gate and up) each
start from the same sequence shard, and each would all-gather it: t-1/t of the gathered
activation sent three times. Whoever builds the layers gives the siblings one
`SharedGather` (`ColumnParallelLinear(..., shared_gather=g)` or `layer.shared_gather = g`).
The first sibling to run gathers with `all_gather_sequence` and the object remembers the
result for that input; the others, called on the same tensor (same object and
`_version`, so an in-place change in between invalidates it; same grad mode), get the
same autograd output back. In backward autograd first sums the siblings' gradients of
that one output, then runs its reduce-scatter once: one all-gather forward and one
reduce-scatter backward for all siblings.
The input is held weakly; the gathered output is dropped when the input is freed (the
caller's forward is over), so nothing outlives a step. Cost: the siblings save the
gathered input for their weight gradients (one tensor, shared), instead of each saving
the shard and re-gathering it in backward (Note [sequence-parallel column layers save
the shard]); and the gather is not chunked for overlap.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from meshspeed.comm.differentiable import all_gather_sequence


class SharedGather:
    def __init__(self, group: Any, seq_dim: int = 1) -> None:
        self.group, self.seq_dim = group, seq_dim
        self._source: weakref.ref | None = None
        self._key: tuple[int, bool] | None = None
        self._gathered: torch.Tensor | None = None
        self.gathers = self.reuses = 0  # for tests and reports

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = (x._version, torch.is_grad_enabled())
        if self._source is not None and self._source() is x and self._key == key:
            self.reuses += 1
            return self._gathered
        gathered = all_gather_sequence(x, self.group, self.seq_dim)
        self._source, self._key, self._gathered = weakref.ref(x, self._forget), key, gathered
        self.gathers += 1
        return gathered

    def _forget(self, ref: weakref.ref) -> None:
        if self._source is ref:
            self._source = self._gathered = self._key = None

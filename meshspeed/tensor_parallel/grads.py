"""What the optimizer step must know about tensor parallelism: which masters hold a piece
of a split parameter (their squares add up over tp in the gradient norm, Note [one norm
across tensor-parallel shards] in optim/clip.py) and which hold partial gradients.

Note [partial gradients of sequence-parallel norms]
Under sequence parallelism a norm runs on one sequence shard per tp rank, so its weight's
gradient on each rank covers only that rank's tokens: the whole gradient is the sum over
the tp group. The sum is linear, so it is taken once per optimizer step on the masters'
gradients (already averaged over data parallel, and possibly a ZeRO shard of them: every
tp rank of one dp coordinate lays out its units identically, so the shards line up), as
one flat all-reduce, not once per micro-batch in backward.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.protocol import StepPart
from meshspeed.parallel.step import NormScope
from meshspeed.topology.shards import partial_grad_params, shards_by_param


class TensorParallelGrads(StepPart):
    """Tensor parallelism's share of the optimizer step: the partial gradients summed over
    tp before it, and which masters the norm counts on every tp rank."""

    def __init__(self, module: nn.Module, group, size: int):
        self.group = group if size > 1 else None
        split = set(shards_by_param(module))
        split |= {id(p) for p in module.parameters() if getattr(p, "tensor_model_parallel", False)}  # Megatron's mark
        self._split = split
        self._partial = partial_grad_params(module)
        self._split_masters: set[int] | None = None  # ids of masters, once the strategy is known

    def before_step(self, strategy) -> None:
        """Sum the partial gradients of sequence-parallel parameters over tp (one collective)."""
        if self.group is None:
            return
        masters = [strategy.master_of[id(p)] for p in self._partial if id(p) in strategy.master_of]
        grads = [m.grad for m in masters if m.grad is not None and m.grad.numel()]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def widen(self, scope: NormScope, strategy) -> NormScope:
        if self.group is None:
            return scope
        split = {id(strategy.master_of[i]) for i in self._split if i in strategy.master_of}
        return replace(scope, tp_group=self.group, tp_split=lambda masters: [id(m) in split for m in masters])

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

import torch
from torch import nn

from meshspeed import comm
from meshspeed.topology.shards import partial_grad_params, shards_by_param


class TensorParallelGrads:
    def __init__(self, module: nn.Module, master_of: dict[int, nn.Parameter], group, size: int):
        self.group = group if size > 1 else None
        split = set(shards_by_param(module))
        split |= {id(p) for p in module.parameters() if getattr(p, "tensor_model_parallel", False)}  # Megatron's mark
        self._split_masters = {id(master_of[i]) for i in split if i in master_of}
        self._partial = [master_of[id(p)] for p in partial_grad_params(module) if id(p) in master_of]

    @property
    def has_partial(self) -> bool:
        return self.group is not None and bool(self._partial)

    @property
    def active(self) -> bool:
        return self.group is not None

    def reduce_partial(self) -> None:
        """Sum the partial gradients of sequence-parallel parameters over tp (one collective)."""
        grads = [m.grad for m in self._partial if m.grad is not None and m.grad.numel()]
        if self.group is None or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def split_mask(self, masters: list[nn.Parameter]) -> list[bool]:
        return [id(m) in self._split_masters for m in masters]

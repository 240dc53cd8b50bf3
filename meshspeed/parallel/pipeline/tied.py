"""Tied layers on several pipeline stages: equal at the start, one gradient for all copies.

Note [summing tied gradients over stages]
A `TiedLayerSpec` key used on stages S (an embedding on the first stage and the LM head
through its weight on the last) is one module per stage (Note [tied layers across stages]
in module.py). A single shared module's gradient is the sum of what each
position contributes, so after each batch, once the strategy has reduced the stage's
gradients over data parallelism, the copies' gradients are summed over S and every copy
takes that same step.

Whatever the stages' sharding, one all-reduce does it: the group is every rank on a stage
of S with this rank's tensor- and context-parallel coordinates (|S| x dp ranks). Each rank
writes the range of the tied tensor it owns (its ZeRO shard's part of it; with whole
gradients only dp rank 0 writes) into a zeroed buffer of the tensor's size, the buffer is
all-reduced, and each rank reads its range back: every stage's dp ranks cover the tensor
exactly once, so the sum is the sum over stages. It moves the whole tied tensor over |S|
x dp ranks; the tied tensors are an embedding or two, summed once per batch.

The copies start equal: before the strategy takes the module, each tied tensor is
broadcast from its first stage over the |S| ranks of one (dp, cp, tp) coordinate. They
stay equal because each takes the same gradient through an elementwise optimizer step.
The gradient norm counts each tied tensor once: copies off its first stage are left out.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm


def _sum_layout(dims, stages: list[int]) -> list[list[int]]:
    """Per (cp, tp) coordinate: every rank of every stage in `stages` (|S| x dp ranks)."""
    return [sorted(dims.rank_of(pp=s, dp=d, cp=c, tp=t) for s in stages for d in range(dims.dp))
            for t in range(dims.tp) for c in range(dims.cp)]


def _copy_layout(dims, stages: list[int]) -> list[list[int]]:
    """Per (dp, cp, tp) coordinate: that coordinate's rank on each stage in `stages`."""
    return [sorted(dims.rank_of(pp=s, dp=d, cp=c, tp=t) for s in stages)
            for t in range(dims.tp) for c in range(dims.cp) for d in range(dims.dp)]


class TiedGrads:
    """The tied tensors of this stage and the groups they are summed over."""

    def __init__(self, module, topology):
        """`module`: a bound PipelineModule."""
        self.entries: list[tuple[str, nn.Parameter, object, bool]] = []  # key, param, group, first
        self._copies: list[tuple[nn.Parameter, object, int]] = []
        if topology.size("pp") == 1:
            return
        dims, stage = topology.dims, topology.coord("pp")
        weights = module.get_tied_weights()
        for key, stages in sorted(module.tied_stages().items()):  # the same order on every rank
            if len(stages) < 2:
                continue
            # every rank creates every group (collective), in this fixed order
            sum_group = topology.subgroup(f"tied {key}: sum", _sum_layout(dims, stages))
            copy_group = topology.subgroup(f"tied {key}: copies", _copy_layout(dims, stages))
            if stage not in stages:
                continue
            for p in weights.get(key, []):
                self.entries.append((key, p, sum_group, stage == stages[0]))
                self._copies.append((p, copy_group, stages[0]))

    @property
    def active(self) -> bool:
        return bool(self.entries)

    @torch.no_grad()
    def broadcast_from_first(self) -> None:
        """Every copy starts as its first stage's (Note [summing tied gradients over stages])."""
        for p, group, _ in self._copies:
            comm.broadcast(p.data, src=0, group=group)  # group rank 0 is the first stage's rank

    def duplicates(self, master_of: dict[int, nn.Parameter]) -> set[int]:
        """ids of masters of tied copies off their first stage (left out of the norm)."""
        return {id(master_of[id(p)]) for _, p, _, first in self.entries if not first and id(p) in master_of}

    @torch.no_grad()
    def sum_grads(self, strategy, dp_rank: int) -> None:
        """Sum the tied tensors' reduced gradients over their stages (after prepare_step)."""
        for _, p, group, _ in self.entries:
            master = strategy.master_of.get(id(p))
            access = strategy.param_access(p)
            numel = access.shape.numel()
            full = torch.zeros(numel, dtype=torch.float32, device=p.device)
            grad = None if master is None else master.grad
            if grad is not None and (access.sharded or dp_rank == 0):
                full[access.start : access.end] = grad.reshape(-1).float()
            comm.all_reduce(full, group=group)
            if grad is not None:
                grad.copy_(full[access.start : access.end].view_as(grad))


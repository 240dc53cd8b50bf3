"""What a sharding strategy needs to know about expert parameters (expert parallelism).

Note [expert parameters in the strategies]
Under expert parallelism the ep ranks of a data-parallel group hold DIFFERENT experts;
only the ranks of one edp group (every ep-th dp rank) hold the same ones. So, for expert
parameters only: initial weights are broadcast over edp, gradients are reduced (stage 0)
or reduce-scattered (ZeRO) over edp and divided by the whole dp size (Note [gradients of
expert parameters] in meshspeed/moe/layer.py: after backward an expert gradient already
sums its ep group's tokens), ZeRO shards them over edp, and checkpoints name them by
their global expert id. Dense parameters are unchanged: replicated or sharded over dp.
With tensor parallelism the ep and edp groups lie within one tp coordinate and each tp
rank holds whole experts, replicas over tp like any parameter tp leaves whole (Note [MoE
layers on tensor-parallel ranks] in meshspeed/moe/axis.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ExpertSpec:
    group: Any  # the edp group: the ranks holding the same experts as this one
    dp_size: int  # expert gradients are divided by this (all data-parallel ranks), not by edp
    names: dict[int, str] = field(default_factory=dict)  # id(param) -> name with the global expert id

    def holds(self, param: nn.Parameter) -> bool:
        return id(param) in self.names

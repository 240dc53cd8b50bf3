"""The process groups one ZeRO unit communicates over.

A unit shards its state over `shard` and, when `replicate` is set, keeps that shard
replicated over `replicate` (hybrid sharding: shard within a node, replicate across nodes;
expert-data-parallel groups are a further instance). `secondary`, for stage-3 units, is
ZeRO++ hpZ's group: a few ranks of `shard` (one node) that together hold a second copy of
the unit, partitioned among them, so that gathers after the first in a step stay inside
it (hpz.py). The strategy hands each unit its groups; nothing looks a group up from a
global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshspeed import comm


@dataclass(frozen=True)
class UnitGroups:
    shard: Any = None  # the group the unit's state is sharded over (None: the world)
    replicate: Any = None  # the group each shard is replicated over (None: no replication)
    # what the reduced gradient is divided by; None: `size`. Expert units shard over edp
    # but divide by the whole dp size (Note [expert parameters in the strategies])
    average_over: int | None = None
    secondary: Any = None  # ZeRO++ hpZ: this rank's group of the secondary partition
    nodes: Any = None  # ZeRO++ qgZ's two hops: a qgz.NodeGroups, or None (one hop)

    @property
    def size(self) -> int:
        """How many ranks contribute to each gradient: shard size x replicate size."""
        n = comm.get_world_size(self.shard)
        return n * (comm.get_world_size(self.replicate) if self.replicate is not None else 1)

    @property
    def divisor(self) -> int:
        """What the summed gradient is divided by to give the data-parallel mean."""
        return self.size if self.average_over is None else self.average_over

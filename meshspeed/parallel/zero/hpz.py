"""ZeRO++ hpZ: a secondary copy of each stage-3 unit, partitioned inside a node.

Wang et al., "ZeRO++" (arXiv:2306.10209), Section 3.2. Plain stage 3 gathers a unit
from all N ranks of its shard group twice a step, in forward and again in backward, and
on a cluster most of those N ranks sit in other nodes. hpZ splits the shard group into
N / K groups of K consecutive ranks (`zero_hpz_partition_size` = K, one node), and each
rank keeps, besides its primary shard (1/N of the unit), a secondary one: 1/K of the unit,
its slot in its node group. The first gather of a unit after the parameters change (the
forward one) runs over all N ranks as before; the rank then copies its slot out of the
full unit. Every later gather until the parameters change again (backward, and the
forward and backward of further micro-steps) is an all-gather of the K secondary slots
inside the node: the bytes across nodes of a step's backward go from M to 0 (M = the
gathered bytes of all units), for an extra M / K resident per rank.

Note [what the secondary copy holds]
The secondary slot is copied from the working weights the first gather produced, so
backward computes with exactly the weights forward used: hpZ alone changes no value
(its parity test is bit for bit). Under qwZ those are the dequantized INT8 weights,
which backward then sees unchanged instead of re-quantized. The copy is stale as soon as
the shard changes: `FlatUnit` drops it when a step publishes the masters, when a user
writes the parameters (GatheredParameters with a modifier, safe_set_full_fp32_param) and
on a checkpoint load, all of which go through its shard writes. A user's exact gather
under qwZ reads the primary shards, never the quantized slot.
"""

from __future__ import annotations

from typing import Any

import torch

from meshspeed import comm


class SecondaryPartition:
    """One unit's slot in its node group: `fill` it from the full flat buffer, then
    `gather_into` that buffer from the group's slots until `invalidate`."""

    def __init__(self, padded_numel: int, group: Any, dtype: torch.dtype, device: torch.device):
        self.group = group
        self.size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        if padded_numel % self.size:
            raise ValueError(f"a unit of {padded_numel} padded elements does not split over "
                             f"{self.size} hpZ ranks")
        self.numel = padded_numel // self.size
        self.slot = torch.empty(self.numel, dtype=dtype, device=device)
        self.fresh = False

    def fill(self, flat: torch.Tensor) -> None:
        lo = self.rank * self.numel
        self.slot.copy_(flat[lo : lo + self.numel])
        self.fresh = True

    def gather_into(self, flat: torch.Tensor):
        """Start the node-local all-gather of every slot into `flat`; returns the work."""
        return comm.all_gather_into_tensor(flat, self.slot, group=self.group, async_op=True)

    def invalidate(self) -> None:
        self.fresh = False

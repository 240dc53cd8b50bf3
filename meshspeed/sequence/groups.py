"""The two sub-axes of a hybrid (USP) sequence mesh, cut from the mesh's cp axis.

The cp coordinate of a rank is `ring_index * ulysses_size + ulysses_index`: all-to-all
groups are runs of `ulysses_size` consecutive cp ranks (the nearest, fastest links, where
all-to-all's many small messages pay least), ring groups take every `ulysses_size`-th.
"""

from __future__ import annotations

import torch.distributed as dist

from meshspeed.topology import Topology


def hybrid_layouts(cp_groups: list[list[int]], ulysses_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(all-to-all groups, ring groups) of global ranks for every cp group of the mesh."""
    ulysses, ring = [], []
    for ranks in cp_groups:  # each sorted: position = cp coordinate
        if len(ranks) % ulysses_size:
            raise ValueError(f"ulysses_size {ulysses_size} does not divide the context-parallel "
                             f"degree {len(ranks)}")
        rings = len(ranks) // ulysses_size
        ulysses += [ranks[j * ulysses_size:(j + 1) * ulysses_size] for j in range(rings)]
        ring += [ranks[i::ulysses_size] for i in range(ulysses_size)]
    return ulysses, ring


def hybrid_groups(topology: Topology, ulysses_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (all-to-all group, ring group). Collective over the world the first
    time (every rank creates every group, in the same order)."""
    ulysses, ring = hybrid_layouts(topology.dims.groups("cp"), ulysses_size)
    return (topology.subgroup(f"cp all-to-all ({ulysses_size})", ulysses),
            topology.subgroup(f"cp ring ({ulysses_size})", ring))

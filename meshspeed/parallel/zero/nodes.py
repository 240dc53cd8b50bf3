"""Which ranks of a ZeRO group share a node: the layouts of ZeRO++'s node groups.

hpZ (hpz.py) keeps a secondary partition over `zero_hpz_partition_size` consecutive ranks
of each ZeRO group; qgZ (qgz.py, Note [qgZ's two hops]) reduces inside those same groups
first, or, without hpZ, inside each physical node, then across nodes among the ranks at
the same place. Each function returns, per ZeRO group, its node blocks (global ranks,
ascending); `inside` and `across` flatten them into layouts, the same list on every rank,
for `Topology.subgroup` (topology/mesh.py). Launchers place consecutive global ranks
on a node, so node i holds ranks [i L, (i+1) L).
"""

from __future__ import annotations

Blocks = list[list[list[int]]]  # per ZeRO group, its node blocks


def blocks(shard_groups: list[list[int]], size: int) -> Blocks:
    """Each ZeRO group (global ranks) cut into consecutive blocks of `size` ranks: hpZ's
    partition groups (`zero_hpz_partition_size` = size)."""
    out = []
    for ranks in shard_groups:
        if len(ranks) % size:
            raise ValueError(f"zero_hpz_partition_size {size} does not divide the ZeRO group of "
                             f"{len(ranks)} ranks {sorted(ranks)}; pick a divisor of {len(ranks)}")
        ranks = sorted(ranks)
        out.append([ranks[i : i + size] for i in range(0, len(ranks), size)])
    return out


def by_node(shard_groups: list[list[int]], ranks_per_node: int) -> Blocks:
    """Each ZeRO group split by physical node (global rank // ranks_per_node); every node
    must hold the same number of the group's ranks."""
    out = []
    for ranks in shard_groups:
        parts: dict[int, list[int]] = {}
        for r in sorted(ranks):
            parts.setdefault(r // ranks_per_node, []).append(r)
        sizes = sorted({len(p) for p in parts.values()})
        if len(sizes) > 1:
            raise ValueError(f"the ZeRO group {sorted(ranks)} has {sizes} ranks on different nodes "
                             f"({ranks_per_node} ranks per node); qgZ's two hops need the same number on each")
        out.append(list(parts.values()))
    return out


def inside(groups: Blocks) -> list[list[int]]:
    """Every node block of every ZeRO group: the groups of the hop inside a node."""
    return [block for group in groups for block in group]


def across(groups: Blocks) -> list[list[int]]:
    """Per ZeRO group, the ranks at the same place in each of its node blocks: the groups
    of the hop across nodes."""
    return [[block[place] for block in group] for group in groups for place in range(len(group[0]))]

"""build_topology on 4 gloo ranks: every axis's ProcessGroup is the group ParallelDims names."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshspeed.testing import run_distributed
from meshspeed.topology.degrees import AXES, ParallelDims
from meshspeed.topology.mesh import build_mesh, build_topology

LAYOUTS = [{"tp": 2, "ep": 2}, {"cp": 2}, {"pp": 2, "ep": 2}, {"ep": 2}]


def _groups_on_this_rank(layouts: list[dict]) -> list[dict]:
    rank, seen = dist.get_rank(), []
    for kwargs in layouts:
        dims = ParallelDims(dist.get_world_size(), **kwargs)
        topo = build_topology(dims)
        assert topo.mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
        found = {}
        for axis in AXES:
            group = topo.group(axis)
            ranks = dist.get_process_group_ranks(group)
            assert dist.get_rank(group) == topo.coord(axis), (kwargs, axis)
            total = torch.tensor([rank])
            dist.all_reduce(total, group=group)  # the group really connects these ranks
            assert total.item() == sum(ranks), (kwargs, axis)
            found[axis] = sorted(ranks)
        seen.append(found)
    try:
        build_mesh(ParallelDims(8, tp=2))
    except ValueError as exc:
        assert "world_size 8" in str(exc) and "4 ranks" in str(exc)
    else:
        raise AssertionError("a ParallelDims for the wrong world size was accepted")
    return seen


@pytest.mark.timeout(300)
def test_build_topology_groups_match_parallel_dims():
    results = run_distributed(_groups_on_this_rank, 4, args=(LAYOUTS,), timeout=240)
    for rank, per_layout in enumerate(results):
        for kwargs, found in zip(LAYOUTS, per_layout):
            dims = ParallelDims(4, **kwargs)
            assert found == {axis: dims.group_of(axis, rank) for axis in AXES}, (rank, kwargs)

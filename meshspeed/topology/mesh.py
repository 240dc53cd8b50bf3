"""The named DeviceMesh for a ParallelDims, and this rank's process group on every axis.

Everything here is collective: every rank of the default process group must call
``build_mesh`` / ``build_topology`` with equal ``ParallelDims``. The resulting
``Topology`` is handed to the engine, which passes each strategy the groups it needs;
nothing here is stored in a global.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshspeed.topology.degrees import AXES, DERIVED_AXES, MESH_DIM_NAMES, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """A DeviceMesh of shape ``(pp, dp, cp, tp)`` whose layout is ``dims.rank_of``.

    Collective; the default process group must exist and have ``dims.world_size`` ranks.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialized (init_distributed)")
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"ParallelDims is for world_size {dims.world_size}, but the process "
                         f"group has {world} ranks")
    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names)
    # init_device_mesh lays ranks out row-major, which is exactly rank_of; check rather than
    # trust it, because every group below is derived from the same arithmetic.
    expected = torch.arange(dims.world_size).reshape(dims.mesh_shape)
    if not torch.equal(mesh.mesh.cpu(), expected):
        raise RuntimeError(f"DeviceMesh layout {mesh.mesh.tolist()} does not match ParallelDims")
    return mesh


class Topology:
    """This rank's view of the layout: degrees, mesh, and one ProcessGroup per axis."""

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh, groups: dict[str, dist.ProcessGroup],
                 rank: int) -> None:
        missing = set(AXES) - set(groups)
        if missing:
            raise ValueError(f"Topology is missing groups for {sorted(missing)}")
        self.dims = dims
        self.mesh = mesh
        self.rank = rank
        self._groups = dict(groups)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank on ``axis`` (any of ``degrees.AXES``)."""
        if axis not in self._groups:
            raise ValueError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on ``axis``, sorted."""
        return self.dims.group_of(axis, self.rank)

    def coord(self, axis: str) -> int:
        """This rank's position in its ``axis`` group (its rank within that group)."""
        return self.dims.coords(self.rank)[axis]

    def size(self, axis: str) -> int:
        return self.dims.size(axis)

    def submesh(self, axis: str) -> DeviceMesh:
        """1-D sub-mesh for a mesh axis ("pp", "dp", "cp" or "tp")."""
        if axis not in MESH_DIM_NAMES:
            raise ValueError(f"{axis!r} is not a mesh dimension; expected one of {MESH_DIM_NAMES}")
        return self.mesh[axis]

    def __repr__(self) -> str:
        return f"Topology(rank {self.rank} of {self.dims})"


def build_topology(dims: ParallelDims, device_type: str = "cpu") -> Topology:
    """Build the mesh and the derived-axis groups. Collective over the whole world."""
    mesh = build_mesh(dims, device_type)
    rank = dist.get_rank()
    groups = {axis: mesh.get_group(axis) for axis in MESH_DIM_NAMES}
    for axis in DERIVED_AXES:  # fixed order: every rank creates the same groups in turn
        groups[axis] = _derived_group(dims, axis, rank, groups)
    return Topology(dims, mesh, groups, rank)


def _derived_group(dims: ParallelDims, axis: str, rank: int,
                   mesh_groups: dict[str, dist.ProcessGroup]) -> dist.ProcessGroup:
    layout = dims.groups(axis)
    for mesh_axis in MESH_DIM_NAMES:  # e.g. dp_cp == dp when cp == 1; ep == dp when edp == 1
        if dims.groups(mesh_axis) == layout:  # depends only on dims: all ranks agree
            return mesh_groups[mesh_axis]
    mine = None
    # new_group is collective over the default group: every rank must create every group,
    # including the ones it is not in, in the same order, or the job deadlocks.
    for ranks in layout:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None, f"rank {rank} is in no {axis} group"
    return mine

"""The named DeviceMesh for a ParallelDims, and this rank's process group on every axis.

Everything here is collective: every rank of the default process group must call
``build_mesh`` / ``build_topology`` with equal ``ParallelDims``. The resulting
``Topology`` is handed to the engine, which passes each strategy and layer the groups it
needs; no code looks a group up from anywhere but the Topology it was given.

Note [one mesh per layout]
Building a mesh creates process groups (a collective, and sockets on gloo), and a process
may call `meshspeed.initialize` many times (tests, notebooks, a second model). So
`build_topology` memoises one Topology per layout for the life of the default group:
asking twice for tp=2 on the same world returns the same groups. The memo is not a
"current group": nothing reads it implicitly, every consumer still receives its groups
from the Topology passed to it. An axis whose group is the whole world uses the default
group itself (pure data parallelism keeps communicating on WORLD, as before the mesh).
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
    """This rank's view of the layout: degrees, mesh, and one ProcessGroup per axis.

    `engine.mesh` is one. It reads like a DeviceMesh where that helps: `topo["tp"]` is the
    1-D sub-mesh, `topo.get_group("dp")`, `topo.get_local_rank("tp")`."""

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh | None, groups: dict[str, dist.ProcessGroup],
                 rank: int, source: str = "config") -> None:
        missing = set(AXES) - set(groups)
        if missing:
            raise ValueError(f"Topology is missing groups for {sorted(missing)}")
        self.dims = dims
        self.mesh = mesh  # None when the groups came from a Megatron-style mpu
        self.rank = rank
        self.source = source  # "config" or "mpu": where the layout came from
        self._groups = dict(groups)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank on ``axis`` (any of ``degrees.AXES``)."""
        if axis not in self._groups:
            raise ValueError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")
        return self._groups[axis]

    get_group = group  # DeviceMesh's spelling

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on ``axis``, sorted."""
        if self.source == "mpu":
            return sorted(dist.get_process_group_ranks(self.group(axis)))
        return self.dims.group_of(axis, self.rank)

    def get_local_rank(self, axis: str) -> int:
        return self.coord(axis)

    def __getitem__(self, axis: str) -> DeviceMesh:
        return self.submesh(axis)

    def coord(self, axis: str) -> int:
        """This rank's position in its ``axis`` group (its rank within that group)."""
        if self.source == "mpu":
            return self.ranks(axis).index(self.rank)
        return self.dims.coords(self.rank)[axis]

    def size(self, axis: str | None = None) -> int:
        """Ranks in each group of ``axis``; the world size without one (as DeviceMesh)."""
        return self.dims.world_size if axis is None else self.dims.size(axis)

    def submesh(self, axis: str) -> DeviceMesh:
        """1-D sub-mesh for a mesh axis ("pp", "dp", "cp" or "tp")."""
        if axis not in MESH_DIM_NAMES:
            raise ValueError(f"{axis!r} is not a mesh dimension; expected one of {MESH_DIM_NAMES}")
        if self.mesh is None:
            raise ValueError("this layout came from an mpu object's process groups; it has no "
                             "DeviceMesh (use .group(axis))")
        return self.mesh[axis]

    def __repr__(self) -> str:
        return f"Topology(rank {self.rank} of {self.dims})"


_built: dict[tuple, Topology] = {}  # Note [one mesh per layout]
_built_for: list[int] = []  # id of the default group the memo belongs to


def build_topology(dims: ParallelDims, device_type: str = "cpu") -> Topology:
    """The mesh and every axis's group for `dims`. Collective over the whole world the
    first time a layout is asked for; later calls return the same Topology."""
    world_pg = dist.group.WORLD
    if _built_for != [id(world_pg)]:  # a new default group: the old groups are gone
        _built.clear()
        _built_for[:] = [id(world_pg)]
    key = (dims, device_type)
    if key not in _built:
        mesh = build_mesh(dims, device_type)
        rank = dist.get_rank()
        groups = {axis: _whole_world_or(dims, axis, mesh.get_group(axis)) for axis in MESH_DIM_NAMES}
        for axis in DERIVED_AXES:  # fixed order: every rank creates the same groups in turn
            groups[axis] = _derived_group(dims, axis, rank, groups)
        _built[key] = Topology(dims, mesh, groups, rank)
    return _built[key]


def _whole_world_or(dims: ParallelDims, axis: str, group: dist.ProcessGroup) -> dist.ProcessGroup:
    return dist.group.WORLD if dims.size(axis) == dims.world_size else group


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


_extra: dict[tuple, dist.ProcessGroup | None] = {}  # Note [one mesh per layout], for extra groups
_extra_for: list[int] = []


def group_from_layout(layout: list[list[int]]) -> dist.ProcessGroup | None:
    """This rank's group of `layout` (a partition of some ranks into groups, the same list
    on every rank), or None if it is in none. Collective over the default group the first
    time a layout is asked for (every rank creates every group, in order); memoised.
    For groups the mesh does not name, such as the stages sharing a tied layer."""
    world_pg = dist.group.WORLD
    if _extra_for != [id(world_pg)]:
        _extra.clear()
        _extra_for[:] = [id(world_pg)]
    key = tuple(tuple(sorted(g)) for g in layout)
    if key not in _extra:
        rank, mine = dist.get_rank(), None
        for ranks in key:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = group
        _extra[key] = mine
    return _extra[key]

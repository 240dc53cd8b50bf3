"""The named DeviceMesh for a ParallelDims, and this rank's process group on every axis.

Everything here is collective: every rank of the default process group must call
``build_mesh`` / ``build_topology`` with equal ``ParallelDims``. The resulting
``Topology`` is handed to the engine, which passes each strategy and layer the groups it
needs; no code looks a group up from anywhere but the Topology it was given.

Note [sub-axis groups]
Some groups are not an axis of the mesh: the two sub-axes of a hybrid sequence mesh,
ZeRO++'s node groups (hpZ's secondary partition, qgZ's two hops), the stages sharing a
tied layer. They are still the mesh's: `topology.subgroup(name, layout)` makes them on
the Topology the engine holds, once per name (a layout already made under another name
reuses its groups), and `str(engine.mesh)` lists them with the axes.

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
        self._sub: dict[str, tuple[tuple, dist.ProcessGroup | None]] = {}  # Note [sub-axis groups]

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

    def subgroup(self, name: str, layout: list[list[int]]) -> dist.ProcessGroup | None:
        """This rank's group of `layout` (a partition of ranks into groups, the same list on
        every rank), None if it is in none; recorded under `name` (Note [sub-axis groups]).
        Collective over the world the first time a name is asked for."""
        key = tuple(tuple(sorted(g)) for g in layout)
        if name in self._sub:
            if self._sub[name][0] != key:
                raise ValueError(f"sub-axis group {name!r} was made with another layout")
            return self._sub[name][1]
        same = next((group for known, group in self._sub.values() if known == key), None)
        if same is None and not any(known == key for known, _ in self._sub.values()):
            for ranks in key:  # every rank creates every group, in this order
                group = dist.new_group(list(ranks))
                if self.rank in ranks:
                    same = group
        self._sub[name] = (key, same)
        return same

    def subgroups(self) -> dict[str, list[int] | None]:
        """Every sub-axis group made so far: name -> this rank's ranks in it (None: in none)."""
        return {name: next((list(g) for g in key if self.rank in g), None)
                for name, (key, _) in self._sub.items()}

    def __repr__(self) -> str:
        return f"Topology(rank {self.rank} of {self.dims})"

    def __str__(self) -> str:
        """The layout and every group of this rank: `print(engine.mesh)`."""
        lines = [repr(self)]
        for axis in (*MESH_DIM_NAMES, *DERIVED_AXES):
            if self.size(axis) > 1:
                lines.append(f"  {axis:<6} {self.ranks(axis)}")
        for name, ranks in self.subgroups().items():
            lines.append(f"  {name:<6} {ranks if ranks is not None else '(not in one)'}")
        return "\n".join(lines)


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

"""Parallel degrees (pure rank math, testable without processes) and the named DeviceMesh."""

from meshspeed.topology.degrees import AXES, MESH_DIM_NAMES, ParallelDims
from meshspeed.topology.mesh import Topology, build_mesh, build_topology
from meshspeed.topology.mpu import topology_from_mpu

__all__ = ["AXES", "MESH_DIM_NAMES", "ParallelDims", "Topology", "build_mesh", "build_topology", "topology_from_mpu"]

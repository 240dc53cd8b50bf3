"""The mesh `initialize` builds: parallel degrees from the typed config and the model, data
parallelism what is left of the world; or, with `initialize(mpu=...)`, the mpu's own
process groups. Every group the engine, the strategies and the layers use comes from this
one Topology (sub-axis groups included: Note [sub-axis groups] in topology/mesh.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshspeed import comm
from meshspeed.config import ConfigError, MeshspeedConfig
from meshspeed.moe.axis import ep_degree
from meshspeed.parallel.pipeline.module import PipelineModule
from meshspeed.process.distributed import describe_world
from meshspeed.tensor_parallel.axis import check_requested_group, tp_degree
from meshspeed.topology import ParallelDims, Topology, build_topology, topology_from_mpu
from meshspeed.topology.degrees import launch_hint

__all__ = ["Degrees", "build_layout", "describe_layout", "mesh_param_degrees", "requested_degrees"]


class Degrees(dict):
    """tp, pp, cp, ep asked for by the config and the model (dp is what the world leaves)."""


def pipeline_degree(config: MeshspeedConfig, model: nn.Module) -> int:
    """pp: the PipelineModule's number of stages; the config's `pipeline.stages`, when a
    number, must agree (a plain module cannot be split by a config key alone)."""
    stages = model.num_stages if isinstance(model, PipelineModule) else 1
    raw = config.pipeline.stages
    if raw not in ("auto", None) and raw != stages:
        what = (f"the PipelineModule has num_stages={stages}" if isinstance(model, PipelineModule)
                else f"the model is a {type(model).__name__}, not a PipelineModule (one stage)")
        raise ConfigError([(f"pipeline.stages: {raw}, but {what}; set \"stages\": \"auto\" or build "
                           f"PipelineModule(..., num_stages={raw})")])
    return stages


def mesh_param_degrees(mesh_param: Any) -> tuple[int, int] | None:
    """DeepSpeed's `initialize(mesh_param=(dp, sp))`: data-parallel and Ulysses degrees."""
    if mesh_param is None:
        return None
    ok = (isinstance(mesh_param, (tuple, list)) and len(mesh_param) == 2
          and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh_param))
    if not ok:
        raise ConfigError([(f"initialize(mesh_param={mesh_param!r}): expected (data_parallel_size, "
                           "sequence_parallel_size), two positive integers")])
    return int(mesh_param[0]), int(mesh_param[1])


def requested_degrees(config: MeshspeedConfig, model: nn.Module, mesh: tuple[int, int] | None) -> Degrees:
    tp, pp, cp, ep = tp_degree(config, model), pipeline_degree(config, model), config.sequence.size, ep_degree(model)
    if mesh is not None and mesh[1] > 1:
        if cp > 1 and cp != mesh[1]:
            raise ConfigError([(f"initialize(mesh_param={mesh}) asks for sequence parallel size {mesh[1]}, "
                               f"the config for {cp}; make them equal or give one")])
        cp = mesh[1]
    return Degrees(tp=tp, pp=pp, cp=cp, ep=ep)


def build_layout(config: MeshspeedConfig, degrees: Degrees, mpu: Any, device: torch.device,
                 model: nn.Module, mesh: tuple[int, int] | None = None) -> Topology:
    """The Topology for this run (`mesh`: DeepSpeed's mesh_param (dp, sp)). Collective
    over the world."""
    tp, pp, cp, ep = degrees["tp"], degrees["pp"], degrees["cp"], degrees["ep"]
    if mpu is not None:
        topology = topology_from_mpu(mpu)
        if tp > 1 and tp != topology.size("tp"):
            raise ConfigError([(f"tensor_parallel.autotp_size: {tp}, but the mpu's model-parallel "
                               f"group has {topology.size('tp')} ranks; make them equal or drop the key")])
        return topology
    world = comm.get_world_size()
    if world % (tp * pp * cp):
        what = (f"tensor_parallel.autotp_size: {tp}" + (f" x {pp} pipeline stages" if pp > 1 else "")
                + (f" x context parallel size {cp}" if cp > 1 else ""))
        raise ConfigError([(f"{what} does not divide the world size {world} ({describe_world()}); "
                           f"{launch_hint(tp * pp * cp, world)}")])
    dp_size = world // (tp * pp * cp)
    if dp_size % ep:
        raise ConfigError([(f"MoE ep_size {ep} does not divide the data-parallel size {dp_size} "
                           f"({world} ranks / tensor, pipeline and context degrees); use an ep_size "
                           f"that divides {dp_size}, or {launch_hint(tp * pp * cp * ep, world)}")])
    topology = build_topology(ParallelDims(world, tp=tp, pp=pp, cp=cp, ep=ep), device_type=device.type)
    for what, want in (("initialize(mesh_param=...)", mesh[0] if mesh else None),
                       ("data_parallel_size", config.data_parallel_size)):
        if want is not None and want != topology.size("dp"):
            raise ConfigError([(f"{what} asks for data parallel size {want}, but {world} ranks with "
                               f"{describe_layout(topology)} leave {topology.size('dp')}; make them agree")])
    check_requested_group(model, topology)
    return topology


def describe_layout(topology: Topology) -> str:
    """"dp=4" or "tp=2 x dp=2 (from an mpu)", for logs and batch-size errors."""
    dims = topology.dims
    parts = [f"{axis}={dims.size(axis)}" for axis in ("pp", "tp", "cp") if dims.size(axis) > 1]
    text = " x ".join(parts + [f"dp={dims.dp}"])
    if dims.ep > 1:
        text += f" (ep={dims.ep} x edp={dims.edp})"
    if topology.source == "mpu":
        return text + " (from the mpu's groups)"
    return text + f" of {describe_world()}" if parts else text + f" ({describe_world()})"

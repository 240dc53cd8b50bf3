"""The mesh `initialize` builds, and tensor parallelism applied over it.

The parallel degrees come from the config (`tensor_parallel.autotp_size`; pipeline,
context and expert degrees arrive with their features), data parallelism is what is left
of the world; or, with `initialize(mpu=...)`, from the mpu's own process groups. Every
group the engine, the strategies and the layers use comes from this one Topology.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshspeed import comm
from meshspeed.config import ConfigError, MeshspeedConfig
from meshspeed.config.context_parallel import ContextParallelConfig, resolve
from meshspeed.config.loader import _read
from meshspeed.config.tensor_parallel import TensorParallelConfig
from meshspeed.process.distributed import describe_world
from meshspeed.topology import ParallelDims, Topology, build_topology, topology_from_mpu


def tensor_parallel_section(config: Any) -> TensorParallelConfig:
    """The `tensor_parallel` section alone, read before the whole config (whose batch
    triad needs the data-parallel size that the tp degree decides)."""
    if isinstance(config, MeshspeedConfig):
        return config.tensor_parallel
    raw = _read(config).get("tensor_parallel") or {}
    if not isinstance(raw, dict):
        raise ConfigError([f"tensor_parallel: expected an object, got {type(raw).__name__}"])
    raw = dict(raw)
    if "tp_size" in raw and "autotp_size" not in raw:  # the alias; load_config checks the rest
        raw["autotp_size"] = raw.pop("tp_size")
    try:
        return TensorParallelConfig.checked(raw, "tensor_parallel.")
    except ConfigError:
        return TensorParallelConfig()  # load_config reports the problem with the others


def context_parallel_section(config: Any) -> ContextParallelConfig:
    """The effective context-parallel section (`context_parallel` merged with DeepSpeed's
    `sequence_parallel_size`), read before the whole config as the tp section is."""
    if isinstance(config, MeshspeedConfig):
        return config.sequence
    raw = _read(config)
    section = raw.get("context_parallel") or {}
    sp = raw.get("sequence_parallel_size", 1)
    try:
        return resolve(ContextParallelConfig.checked(section, "context_parallel."),
                       sp if isinstance(sp, int) and not isinstance(sp, bool) else 1)
    except (ConfigError, ValueError, TypeError):
        return ContextParallelConfig()  # load_config reports the problem with the others


def tensor_parallel_degree(config: Any, model: nn.Module, mpu: Any) -> int:
    """tp from the config, merged with a `tp_model_init` request recorded on the model
    (the config wins; a different non-default value in each is an error)."""
    from meshspeed.tensor_parallel.deepspeed_api import request_of

    tp = tensor_parallel_section(config).size
    request = request_of(model)
    if request is None:
        return tp
    if tp > 1 and request["tp_size"] != tp:
        raise ConfigError([(f"tensor_parallel.autotp_size: {tp}, but tp_model_init asked for "
                           f"tp_size {request['tp_size']}; make them equal or drop one")])
    if request["tp_group"] is not None and mpu is not None:
        raise ConfigError([("tp_model_init(tp_group=...) and initialize(mpu=...) both give a "
                           "tensor-parallel group; pass one of them")])
    return max(tp, request["tp_size"])


def pipeline_degree(config: Any, model: nn.Module) -> int:
    """pp: the PipelineModule's number of stages; the config's `pipeline.stages`, when a
    number, must agree (a plain module cannot be split by a config key alone)."""
    from meshspeed.parallel.pipeline.module import PipelineModule

    stages = model.num_stages if isinstance(model, PipelineModule) else 1
    raw = config.pipeline.stages if isinstance(config, MeshspeedConfig) else \
        ((_read(config).get("pipeline") or {}).get("stages", "auto") if config is not None else "auto")
    if raw not in ("auto", None) and raw != stages:
        what = (f"the PipelineModule has num_stages={stages}" if isinstance(model, PipelineModule)
                else f"the model is a {type(model).__name__}, not a PipelineModule (one stage)")
        raise ConfigError([(f"pipeline.stages: {raw}, but {what}; set \"stages\": \"auto\" or build "
                           f"PipelineModule(..., num_stages={raw})")])
    return stages


def expert_degree(model: nn.Module) -> int:
    """ep: the `ep_size` of the model's MoE layers (1 without any). Every layer with
    ep_size > 1 must have the same one: the mesh has one ep axis."""
    from meshspeed.moe.utils import expert_layers

    sizes = {name: layer.ep_size for name, layer in expert_layers(model)}
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        first = {size: name for name, size in reversed(list(sizes.items()))}
        which = ", ".join(f"{first[n]!r} has ep_size {n}" for n in distinct)
        raise ConfigError([(f"MoE layers with different ep_size ({which}): the mesh has one "
                           "expert-parallel axis; build every MoE layer with the same ep_size")])
    return distinct[0] if distinct else 1


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


def build_layout(config: Any, mpu: Any, device: torch.device, model: nn.Module,
                 mesh: tuple[int, int] | None = None) -> Topology:
    """The Topology for this run (`mesh`: DeepSpeed's mesh_param (dp, sp)). Collective
    over the world."""
    tp = tensor_parallel_degree(config, model, mpu)
    pp = pipeline_degree(config, model)
    cp = context_parallel_section(config).size
    ep = expert_degree(model)
    if mesh is not None and mesh[1] > 1:
        if cp > 1 and cp != mesh[1]:
            raise ConfigError([(f"initialize(mesh_param={mesh}) asks for sequence parallel size {mesh[1]}, "
                               f"the config for {cp}; make them equal or give one")])
        cp = mesh[1]
    if cp > 1 and pp > 1:
        raise ConfigError([(f"context parallelism (size {cp}) with a {pp}-stage PipelineModule is not "
                           "supported in this version; use one of them (context parallelism composes "
                           "with data, tensor parallelism and every ZeRO stage)")])
    if cp > 1 and mpu is not None:
        raise ConfigError([(f"context parallelism (size {cp}) with initialize(mpu=...): the sequence "
                           "groups come from the mesh; drop mpu= and give tensor_parallel.autotp_size")])
    if mpu is not None and pp > 1:
        raise ConfigError([(f"initialize(mpu=...) with a {pp}-stage PipelineModule: the pipeline layout "
                           "comes from the module and the config here; drop mpu= (tensor "
                           "parallelism: tensor_parallel.autotp_size)")])
    if ep > 1:
        _check_expert_combinations(ep, cp, pp, mpu)
    if tp > 1 and tensor_parallel_section(config).sequence_parallel:
        _check_moe_without_sequence_parallel(model)
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
        raise ConfigError([(f"{what} does not divide the world size "
                           f"{world} ({describe_world()}); use a divisor of {world}")])
    dp_size = world // (tp * pp * cp)
    if dp_size % ep:
        raise ConfigError([(f"MoE ep_size {ep} does not divide the data-parallel size {dp_size} "
                           f"({world} ranks / tensor, pipeline and context degrees); use an ep_size "
                           f"that divides {dp_size}, or a world size that is a multiple of {ep}")])
    topology = build_topology(ParallelDims(world, tp=tp, pp=pp, cp=cp, ep=ep), device_type=device.type)
    dp = _read(config).get("data_parallel_size") if not isinstance(config, MeshspeedConfig) else \
        config.data_parallel_size
    for what, want in (("initialize(mesh_param=...)", mesh[0] if mesh else None),
                       ("data_parallel_size", dp)):
        if want is not None and want != topology.size("dp"):
            raise ConfigError([(f"{what} asks for data parallel size {want}, but {world} ranks with "
                               f"{describe_layout(topology)} leave {topology.size('dp')}; make them agree")])
    _check_requested_group(model, topology)
    return topology


def _check_expert_combinations(ep: int, cp: int, pp: int, mpu: Any) -> None:
    what = (f"context parallelism (size {cp})" if cp > 1 else
            f"a {pp}-stage PipelineModule" if pp > 1 else
            "initialize(mpu=...)" if mpu is not None else None)
    if what is not None:
        raise ConfigError([(f"expert parallelism (MoE ep_size {ep}) with {what} is not supported in "
                           "this version; expert parallelism composes with data, tensor parallelism "
                           "and every ZeRO stage")])


def _check_moe_without_sequence_parallel(model: nn.Module) -> None:
    """MoE layers need the whole sequence on every tp rank (Note [MoE layers on
    tensor-parallel ranks] in build.py); sequence parallelism gives each a piece."""
    from meshspeed.moe.utils import expert_layers

    layers = expert_layers(model)
    if layers:
        raise ConfigError([(f"tensor_parallel.sequence_parallel with MoE layers ({layers[0][0]!r}, ...) "
                           "is not supported in this version: every tensor-parallel rank must route "
                           "the whole sequence; turn tensor_parallel.sequence_parallel off")])


def _check_requested_group(model: nn.Module, topology: Topology) -> None:
    import torch.distributed as dist

    from meshspeed.tensor_parallel.deepspeed_api import request_of

    group = (request_of(model) or {}).get("tp_group")
    if group is not None and sorted(dist.get_process_group_ranks(group)) != topology.ranks("tp"):
        raise ConfigError([(f"tp_model_init(tp_group=...): the group's ranks "
                           f"{sorted(dist.get_process_group_ranks(group))} are not this rank's "
                           f"tensor-parallel ranks {topology.ranks('tp')} (tp fastest: ranks "
                           "r, r+1, ... form a group)")])


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


def split_tensor_parallel(model: nn.Module, topology: Topology, cfg: TensorParallelConfig,
                          dtype: torch.dtype) -> nn.Module:
    """Apply tensor parallelism over the mesh's tp axis when the config asks for it. A
    model the user already split (its layers list `tp_shards`) must be split over the same
    ranks; with an mpu and no `autotp_size` the model is the user's own model-parallel
    code (Megatron layers) and is left as it is."""
    from meshspeed.tensor_parallel.deepspeed_api import request_of
    from meshspeed.topology.shards import shards_by_param

    if shards_by_param(model):
        _check_presplit(model, topology)
        _check_experts_whole(model)
        return model
    request = request_of(model)
    if request is not None and request["dtype"] not in (dtype, torch.float32):
        raise ConfigError([(f"tp_model_init(dtype={request['dtype']}): the config trains in {dtype}; "
                           "enable the matching bf16/fp16 section (or pass that dtype)")])
    if request is not None and not cfg.enabled and request["tp_size"] > 1:
        cfg = cfg.model_copy(update={"autotp_size": request["tp_size"]})
    if not cfg.enabled:
        if cfg.sequence_parallel or cfg.tp_overlap_comm:
            raise ConfigError([("tensor_parallel.sequence_parallel / tp_overlap_comm need "
                               "tensor_parallel.autotp_size > 1")])
        return model
    from meshspeed.parallel.zero.init_shards import is_partitioned
    from meshspeed.tensor_parallel import apply_tensor_parallel
    from meshspeed.tensor_parallel.ds_config import plan_from_deepspeed

    if any(is_partitioned(p) for p in model.parameters()):
        raise ConfigError([("tensor_parallel.autotp_size: models built under meshspeed.zero.Init "
                           "cannot be split for tensor parallelism in this version; build the "
                           "model normally (ZeRO-3 still shards it over the data-parallel axis)")])
    plan = None
    if cfg.partition_config is not None:
        plan = plan_from_deepspeed(cfg.partition_config, model)
    apply_tensor_parallel(model, topology, plan, sequence_parallel=cfg.sequence_parallel,
                          overlap_comm=cfg.tp_overlap_comm, overlap_chunks=cfg.overlap_chunks)
    _check_experts_whole(model)
    _same_replicas(model, topology)
    return model


def _check_presplit(model: nn.Module, topology: Topology) -> None:
    import torch.distributed as dist

    want = topology.ranks("tp")
    for name, sub in model.named_modules():
        group = getattr(sub, "group", None) if getattr(sub, "tp_shards", None) else None
        if group is not None and sorted(dist.get_process_group_ranks(group)) != want:
            raise ConfigError([(f"{name}: split over ranks {sorted(dist.get_process_group_ranks(group))}, "
                               f"but this run's tensor-parallel group is {want}; split the model "
                               "over engine.mesh (or the same layout) or let initialize split it")])


def _check_experts_whole(model: nn.Module) -> None:
    """MoE layers stay whole on every tp rank (Note [MoE layers on tensor-parallel ranks]
    in build.py): a plan that split one of their parameters is refused."""
    from meshspeed.moe.utils import expert_layers
    from meshspeed.topology.shards import shards_by_param

    split = shards_by_param(model)
    for name, layer in expert_layers(model):
        hit = next((p for p, param in layer.named_parameters() if id(param) in split), None)
        if hit is not None:
            raise ConfigError([(f"{name}.{hit}: the tensor-parallel plan splits a parameter of an MoE "
                               "layer; MoE layers (experts and router) stay whole on every tensor-"
                               "parallel rank in this version, so leave them out of the plan")])


@torch.no_grad()
def _same_replicas(model: nn.Module, topology: Topology) -> None:
    """Parameters tensor parallelism left whole start equal on every tp rank (tp rank 0's),
    whatever each rank's seed was: they must stay replicas."""
    from meshspeed.topology.shards import shards_by_param

    split = shards_by_param(model)
    group = topology.group("tp")
    for p in model.parameters():
        if id(p) not in split:
            comm.broadcast(p.data, src=0, group=group)

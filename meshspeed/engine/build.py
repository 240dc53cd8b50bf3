"""`meshspeed.initialize`: fixes the order in which the parts of training are composed.

1. process group and device;  2. the mesh: parallel degrees from the config (or the
groups of an `mpu`), data parallel is what is left;  3. config (the batch triad needs the
data-parallel size);  4. tensor parallelism splits the module's layers over the mesh's tp
axis;  5. precision: the module is cast to the compute dtype;  6. the sharding strategy
(stage 0: data parallel; 1-3: ZeRO) takes the module and the mesh's data-parallel group,
and only it;  7. optimizer over the strategy's master tensors;  8. LR schedule;
9. data loader over data-parallel coordinates (all ranks of one tp group read the same
samples);  10. with `checkpoint.auto_resume` and `checkpoint.dir`, the newest complete
checkpoint there is loaded (meshspeed/checkpoint/resume.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from meshspeed import comm
from meshspeed.monitor.autotune_hooks import start_probe
from meshspeed.config import ConfigError, MeshspeedConfig, load_config
from meshspeed.config.no_effect import report_no_effect
from meshspeed.engine.engine import MeshspeedEngine
from meshspeed.engine.layout import (
    build_layout,
    describe_layout,
    mesh_param_degrees,
    split_tensor_parallel,
)
from meshspeed.engine.pipeline import PipelineEngine, check_pipeline
from meshspeed.engine.tied_grads import TiedGrads
from meshspeed.offload import check_host_memory, check_offload, offload_optimizer, offload_placement
from meshspeed.optim.builder import adopt_client_optimizer, build_optimizer, master_groups
from meshspeed.optim.precision import build_scaler
from meshspeed.parallel import registry
from meshspeed.parallel.activation_setup import configure_from_config
from meshspeed.parallel.data.compress import GradCompression
from meshspeed.parallel.data.ddp import DataParallel
from meshspeed.parallel.experts import ExpertSpec
from meshspeed.parallel.pipeline.module import PipelineModule
from meshspeed.parallel.protocol import Strategy
from meshspeed.parallel.zero import nodes, qgz, qwz
from meshspeed.parallel.zero.groups import UnitGroups
from meshspeed.parallel.zero.init_shards import cast_partitioned, gather_partitioned, is_partitioned
from meshspeed.parallel.zero.strategy import Zero
from meshspeed.process.accelerator import get_accelerator
from meshspeed.process.distributed import get_local_world_size, init_distributed
from meshspeed.process.malloc import tune_host_allocator
from meshspeed.topology.mesh import group_from_layout
from meshspeed.compat.deepspeed.utils import groups  # TEMP

log = logging.getLogger("meshspeed")

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Any = None,
    model_parameters: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: str | dict | MeshspeedConfig | None = None,
    config_params: str | dict | None = None,
    mesh_param: Any = None,
    dataloader_seed: int = 0,
):
    """Returns `(engine, optimizer, dataloader, lr_scheduler)`, as DeepSpeed does."""
    if model is None:
        raise ValueError("initialize() needs model=<your nn.Module>")
    probe = start_probe(model)  # `meshspeed autotune`'s probe run: the model's facts, then exit
    if config is None:
        config = config_params
        for attr in ("deepspeed_config", "deepscale_config"):  # DeepSpeed's argparse flags
            if config is None:
                config = getattr(args, attr, None)
    if not comm.is_initialized():
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    accelerator = get_accelerator()
    device = accelerator.device(_local_rank())
    if device.type == "cpu":
        tune_host_allocator()  # Note [a fixed mmap threshold for CPU training]

    mesh = mesh_param_degrees(mesh_param)
    topology = build_layout(config, mpu, device, model, mesh)
    groups.set_layout(topology)  # deepspeed.utils.groups' accessors answer from it
    # context-parallel ranks hold pieces of the same samples: the batch triad counts dp
    # ranks, gradients are averaged and ZeRO shards over dp x cp
    dp_group, dp_size = topology.group("dp_cp"), topology.size("dp")
    cfg = load_config(config, dp_world_size=dp_size, dp_source=describe_layout(topology))
    if topology.size("cp") > cfg.sequence.size:  # the degree came from mesh_param: Ulysses
        cfg = cfg.model_copy(update={"sequence_parallel_size": topology.size("cp")})
    report_no_effect(cfg, rank=comm.get_rank())
    comm.set_timeout(cfg.comms_timeout)  # a wait longer than this is a CommTimeoutError
    check_offload(cfg, client_optimizer=optimizer)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)

    if not any(p.requires_grad for p in model.parameters()):
        count = sum(1 for _ in model.parameters())
        raise ValueError(f"initialize(model=...): {type(model).__name__} has no trainable parameters "
                         f"({count} parameters, all with requires_grad=False); unfreeze some "
                         "(p.requires_grad_(True)) or run the model without an engine for inference")
    pipelined = isinstance(model, PipelineModule)  # any number of stages: DeepSpeed's engine
    if pipelined:
        check_pipeline(model, cfg)
    model = split_tensor_parallel(model, topology, cfg.tensor_parallel, cfg.precision_dtype)
    context = _context_parallel(model, topology, cfg)
    module = _cast(model, device, cfg.precision_dtype)
    tied = TiedGrads(module, topology)  # collective: every rank makes the tied groups
    tied.broadcast_from_first()  # Note [summing tied gradients over stages]
    placement = offload_placement(cfg)
    experts = _wire_experts(module, topology, placement, device)
    strategy = _build_strategy(module, _zero_groups(cfg, topology, dp_group), cfg, placement, experts)
    if not isinstance(strategy, Strategy):  # a strategy missing part of the protocol
        raise TypeError(f"{type(strategy).__name__} does not implement meshspeed.parallel.protocol.Strategy")
    configure_from_config(cfg, topology)  # the activation_checkpointing block, with the tp group
    check_host_memory(strategy, cfg)
    opt = _build_optimizer(cfg, optimizer, model_parameters, module, strategy, placement, dp_group)
    _wire_onebit(opt, strategy, cfg, topology, pipelined)
    registry.attach_optimizer(strategy, opt)  # for safe_get_full_optimizer_state(param, key)
    scheduler = _build_scheduler(cfg, lr_scheduler, opt)
    loader = None
    if training_data is not None:
        from meshspeed.data.loader import distributed_dataloader

        loader = distributed_dataloader(
            training_data, cfg.train_micro_batch_size_per_gpu, dp_rank=topology.coord("dp"),
            dp_size=dp_size, seed=dataloader_seed, collate_fn=collate_fn,
            shuffle=not pipelined,  # DeepSpeed's PipelineEngine reads training_data in order
        )
    comm_logger = _build_comm_logger(cfg)
    engine = (PipelineEngine if pipelined else MeshspeedEngine)(
        module=module, config=cfg, strategy=strategy, optimizer=opt, lr_scheduler=scheduler,
        scaler=build_scaler(cfg.fp16), topology=topology, dataloader=loader,
        comm_logger=comm_logger, device=device,
    )
    if probe is not None:
        probe.watch(module)  # the first forward gives the sequence length and ends the probe
    if context is not None:
        engine.attach_context(*context)
    if pipelined:
        engine.attach_tied(tied)
    if cfg.checkpoint.auto_resume and cfg.checkpoint.dir is not None:
        engine.load_checkpoint(cfg.checkpoint.dir)  # Note [what auto_resume loads]: None on a first run
    if comm.get_rank() == 0:
        log.info("meshspeed: ZeRO stage %d, %s, %s, micro batch %d x accumulation %d",
                 cfg.zero_stage, str(cfg.precision_dtype).replace("torch.", ""),
                 describe_layout(topology), cfg.train_micro_batch_size_per_gpu,
                 cfg.gradient_accumulation_steps)
    return engine, opt, loader, scheduler


def _wire_experts(model: nn.Module, topology, placement, device: torch.device) -> ExpertSpec | None:
    """Hand every MoE layer with ep_size > 1 the mesh's ep group (build_layout made the
    ep axis the layers' ep_size); what the strategy needs to know of their parameters
    (Note [expert parameters in the strategies]), None without expert parallelism.
    MoE layers with ep_size 1 train as any layer: their experts are local, their
    gradients averaged over data parallelism. With tensor parallelism: Note [MoE layers
    on tensor-parallel ranks]."""
    from meshspeed.moe.utils import expert_layers, global_expert_names

    if expert_layers(model) and topology.size("tp") > 1:
        _route_alike_over_tp(model, topology, device)
    if topology.size("ep") == 1:
        return None
    if placement is not None:
        raise ConfigError([(f"expert parallelism (MoE ep_size {topology.size('ep')}) with ZeRO "
                           "offload (offload_optimizer / offload_param) is not supported in this "
                           "version; turn offload off or build the MoE layers with ep_size=1")])
    if any(is_partitioned(p) for p in model.parameters()):
        raise ConfigError([(f"expert parallelism (MoE ep_size {topology.size('ep')}) with a model "
                           "built under meshspeed.zero.Init is not supported in this version "
                           "(zero.Init slices expert weights over all data-parallel ranks); build "
                           "the model normally, ZeRO-3 still shards it")])
    group = topology.group("ep")
    for _, layer in expert_layers(model):
        if layer.ep_size > 1:
            layer.set_expert_group(group)
    names = global_expert_names(model, topology.coord("ep"))
    return ExpertSpec(topology.group("edp"), topology.size("dp"), names)


# Note [MoE layers on tensor-parallel ranks]
# Tensor parallelism leaves MoE layers whole (the GPT's plan names no expert or router;
# `_same_replicas` starts them equal on the tp ranks): each tp rank holds whole local
# experts and, sequence parallelism being refused with MoE (build_layout), receives the
# same replicated tokens. If every tp rank also routes them alike, it computes the same
# outputs, and backward the same expert and router gradients, which are therefore NOT
# reduced over tp (they are replicas, like a norm's weight; the gradient norm counts them
# once through the tp_split mask) and are reduced over dp / edp within this rank's tp
# coordinate, the ep and edp groups being per tp coordinate (topology/degrees.py). Routing
# alike needs the same random draws (RTS, second-expert sampling, jitter: Note [random
# numbers in gating]), which come from the default generators. The engine leaves those
# alone (the tp RNG tracker's per-rank stream is used only inside its fork()), but a
# script may seed each rank differently; so initialize gives every tp rank tp rank 0's
# host and device generator states, once. Draws then stay equal: tp ranks run the same
# code on the same data.


def _route_alike_over_tp(model: nn.Module, topology, device: torch.device) -> None:
    """Note [MoE layers on tensor-parallel ranks]: tp rank 0's generator states everywhere."""
    from meshspeed.moe.utils import expert_layers

    group = topology.group("tp")
    torch.set_rng_state(comm.broadcast_object(torch.get_rng_state(), src=0, group=group))
    if device.type == "cuda":
        state = comm.broadcast_object(torch.cuda.get_rng_state(device).cpu(), src=0, group=group)
        torch.cuda.set_rng_state(state, device)
    if comm.get_rank() == 0 and any(layer.enable_expert_tensor_parallelism for _, layer in expert_layers(model)):
        log.warning("MoE enable_expert_tensor_parallelism=True has no effect: experts are not split "
                    "over tensor parallelism in this version, each tp rank holds whole experts")


def _context_parallel(model: nn.Module, topology, cfg: MeshspeedConfig):
    """(ContextParallel, whether the engine cuts batches) when the mesh has a cp axis."""
    if topology.size("cp") == 1:
        return None
    from meshspeed.sequence.context import ContextParallel
    from meshspeed.sequence.models import attach

    if cfg.tensor_parallel.sequence_parallel:
        raise ConfigError([("tensor_parallel.sequence_parallel with context parallelism: both split "
                           "the sequence; keep context_parallel (it also splits the attention) and "
                           "turn tensor_parallel.sequence_parallel off")])
    context = ContextParallel(cfg.sequence, topology)
    return context, attach(model, context)


def _cast(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`module.to(device, dtype)` that also handles parameters partitioned by zero.Init
    (their storage is empty until initialize builds stage-3 units from their slices)."""
    if not any(is_partitioned(p) for p in module.parameters()):
        return module.to(device=device, dtype=dtype)
    if device.type != "cpu":
        raise ConfigError([f"zero.Init models are built on the CPU in this version; got device {device}"])
    for p in module.parameters():
        if is_partitioned(p):
            cast_partitioned(p, dtype)
        elif p.is_floating_point():
            p.data = p.data.to(dtype)
    for b in module.buffers():
        if b.is_floating_point():
            b.data = b.data.to(dtype)
    return module


def _local_rank() -> int:
    from meshspeed.process.distributed import get_local_rank

    return get_local_rank()


def _comm_dtype(cfg: MeshspeedConfig) -> torch.dtype:
    # gradients are reduced in fp32 unless the config asks for the low-precision dtype
    name = cfg.communication_data_type
    return torch.float32 if name is None else _DTYPES[name]


def _zero_groups(cfg: MeshspeedConfig, topology, dp_group) -> UnitGroups:
    """ZeRO's groups: the dp (x cp) group it shards over and, for ZeRO++, the node groups
    of hpZ's secondary partition and of qgZ's two hops (parallel/zero/nodes.py)."""
    z = cfg.zero_optimization
    size, zero_groups = z.zero_hpz_partition_size, topology.dims.groups("dp_cp")
    hpz_blocks = secondary = hops = None
    try:
        if size > 1:
            hpz_blocks = nodes.blocks(zero_groups, size)
            secondary = group_from_layout(nodes.inside(hpz_blocks))
            if size == topology.size("dp_cp") and comm.get_rank() == 0:
                log.warning("zero_hpz_partition_size %d is the whole ZeRO group: the secondary copy adds "
                            "memory and moves no fewer bytes; use the ranks of one node", size)
        if z.zero_quantized_gradients:  # Note [qgZ's two hops]: hpZ's nodes, else the machines'
            hop_blocks = hpz_blocks or nodes.by_node(zero_groups, get_local_world_size())
            if 1 < len(hop_blocks[0][0]) < topology.size("dp_cp"):
                hops = qgz.NodeGroups(intra=group_from_layout(nodes.inside(hop_blocks)),
                                      inter=group_from_layout(nodes.across(hop_blocks)))
                _check_places(hops, dp_group)
    except ValueError as err:
        raise ConfigError([f"zero_optimization: {err}"]) from err
    return UnitGroups(shard=dp_group, secondary=secondary, nodes=hops)


def _check_places(hops, dp_group) -> None:
    """qgZ's shard j = g L + l must be node g's rank at place l (ascending group ranks)."""
    rank, per_node = comm.get_rank(dp_group), hops.per_node
    if (comm.get_rank(hops.intra), comm.get_rank(hops.inter)) != (rank % per_node, rank // per_node):
        raise ValueError(f"the ZeRO group's rank order does not follow the global ranks (rank {rank} of it is "
                         f"place {comm.get_rank(hops.intra)} of node {comm.get_rank(hops.inter)}); qgZ's two "
                         "hops need ascending groups")


def _build_strategy(module: nn.Module, groups: UnitGroups, cfg: MeshspeedConfig, placement,
                    experts: ExpertSpec | None = None):
    z, group = cfg.zero_optimization, groups.shard
    if cfg.zero_stage == 0:
        for p in module.parameters():  # zero.Init slices: data parallelism needs them whole
            if is_partitioned(p):
                gather_partitioned(p)
        return DataParallel(module, group, bucket_numel=z.reduce_bucket_size,
                            comm_dtype=_comm_dtype(cfg), overlap_comm=z.overlap_comm, experts=experts,
                            compression=_grad_compression(cfg))
    return Zero(
        module, groups, stage=cfg.zero_stage, bucket_numel=z.reduce_bucket_size,
        persistence_threshold=z.stage3_param_persistence_threshold,
        prefetch_numel=z.stage3_prefetch_bucket_size,
        max_live_numel=z.stage3_max_live_parameters, comm_dtype=_comm_dtype(cfg),
        placement=placement, experts=experts,
        weight_block=qwz.BLOCK if z.zero_quantized_weights else None,
        grad_block=qgz.GRAD_BLOCK if z.zero_quantized_gradients else None,
    )


def _grad_compression(cfg: MeshspeedConfig) -> GradCompression | None:
    gc = cfg.gradient_compression  # the config refuses it with ZeRO stages 1-3
    if gc is None:
        return None
    return GradCompression(method=gc.method, ratio=gc.ratio, chunk=gc.chunk,
                           error_feedback=gc.error_feedback, warmup_steps=gc.warmup_steps,
                           two_hop=gc.exchange == "two_hop")


def _build_optimizer(cfg, client, model_parameters, module, strategy, placement, dp_group=None):
    groups = master_groups(model_parameters, module, strategy.master_of)
    if client is not None:
        if cfg.optimizer is not None:
            raise ConfigError(["optimizer: given both in the config and as initialize(optimizer=...); keep one"])
        return adopt_client_optimizer(client, groups, strategy.master_of)
    if cfg.optimizer is None:
        raise ConfigError(
            'optimizer: missing; add an "optimizer" block to the config '
            '(e.g. {"type": "AdamW", "params": {"lr": 3e-4}}) or pass initialize(optimizer=...)'
        )
    try:
        opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), groups, dp_group)
    except (ValueError, TypeError) as err:
        raise ConfigError([str(err)]) from err
    return offload_optimizer(opt, cfg, placement)


def _wire_onebit(opt, strategy, cfg: MeshspeedConfig, topology, pipelined: bool) -> None:
    """1-bit Adam and 0/1 Adam communicate by themselves on some steps (Note [1-bit Adam's
    two phases] in optim/onebit.py, Note [0/1 Adam's schedule] in optim/zero_one.py): the
    stage-0 strategy then leaves gradients local. Refuses the layouts where that is not
    built (DeepSpeed also requires ZeRO stage 0)."""
    from meshspeed.optim.onebit import CompressedOptimizer

    if not isinstance(opt, CompressedOptimizer):
        return
    name, problems = type(opt).__name__, []
    if cfg.zero_stage != 0:
        problems.append(f"optimizer.type: {name} needs ZeRO stage 0 (got stage {cfg.zero_stage}): its "
                        "compressed all-reduce replaces the gradient all-reduce, which ZeRO shards; "
                        "DeepSpeed refuses this too")
    if cfg.precision_dtype != torch.float32:
        problems.append(f"optimizer.type: {name} runs in fp32 only in this version; turn fp16 / bf16 off")
    others = {axis: topology.size(axis) for axis in ("tp", "pp", "cp", "ep")}
    if pipelined or any(size > 1 for size in others.values()):
        layout = ", ".join(f"{axis} {size}" for axis, size in others.items() if size > 1) or "a pipeline"
        problems.append(f"optimizer.type: {name} runs with data parallelism only in this version (got {layout})")
    if cfg.communication_data_type not in (None, "fp32"):
        problems.append(f"communication_data_type: {name} compresses to 1 bit itself; drop communication_data_type")
    if cfg.gradient_compression is not None:
        problems.append(f"gradient_compression with optimizer.type {name}: the optimizer compresses its "
                        "momentum to 1 bit itself; drop gradient_compression")
    if problems:
        raise ConfigError(problems)
    strategy.local_gradients = opt.gradients_local  # Note [gradients left local] in parallel/data/ddp.py


def _build_scheduler(cfg, client, optimizer):
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if cfg.scheduler is None:
        return None
    from meshspeed.optim.schedulers import build_scheduler

    try:
        return build_scheduler(optimizer, cfg.scheduler.type, dict(cfg.scheduler.params))
    except (ValueError, TypeError) as err:
        raise ConfigError([f"scheduler.params: {err}"]) from err


def _build_comm_logger(cfg: MeshspeedConfig):
    if not cfg.comms_logger.enabled:
        return None
    from meshspeed.comm import CommLogger

    return CommLogger.from_config(cfg.comms_logger).start()

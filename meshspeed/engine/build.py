"""The composition root: `build` fixes the order in which the parts of training are made.

1. the process group and device;  2. the config, parsed once (meshspeed/config);
3. the degrees the config and the model ask for, checked against the one composition
table (Note [one composition table]) before anything is built;  4. the mesh: those
degrees, data parallelism what is left of the world (or an mpu's groups); the batch triad
derived for its dp size;  5. the axes, each through its `apply_<axis>` (Note [one contract
for every axis]): pipeline binds the stage, tensor parallelism splits its layers, context
parallelism attaches the attention, the module is cast to the compute dtype, tied layers
are made equal, expert parallelism wires the MoE layers, and the sharding strategy (stage
0 or ZeRO 1-3, offload injected) takes the module;  6. the optimizer over the strategy's
masters (the user's selection resolved by name: Note [model_parameters by name]) and the
1-bit optimizers' hook;  7. the LR schedule and the data loader over data-parallel
coordinates;  8. the engine; with `checkpoint.auto_resume`, the newest checkpoint.

DeepSpeed's `initialize` (its argument names, `args.deepspeed_config`, the 4-tuple) is
meshspeed/compat/api.py, over this.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from meshspeed import comm
from meshspeed.compression.axis import apply_compression
from meshspeed.config import ConfigError, MeshspeedConfig, load_config
from meshspeed.config.composition import FEATURES, check, config_features
from meshspeed.config.no_effect import report_no_effect
from meshspeed.data.loader import distributed_dataloader
from meshspeed.engine.banner import banner_lines, whole_param_count
from meshspeed.engine.engine import MeshspeedEngine
from meshspeed.engine.layout import (
    build_layout,
    describe_layout,
    mesh_param_degrees,
    requested_degrees,
)
from meshspeed.engine.parts import Composed
from meshspeed.engine.pipeline import PipelineEngine
from meshspeed.engine.unused import UnusedParameterCheck
from meshspeed.moe.axis import apply_ep
from meshspeed.moe.utils import expert_layers
from meshspeed.monitor.autotune_hooks import start_probe
from meshspeed.offload import (
    check_host_memory,
    check_offload,
    choose_unset_knobs,
    enable_update_in_backward,
    offload_optimizer,
    offload_placement,
)
from meshspeed.optim.builder import ParamSelection, adopt_client_optimizer, build_optimizer
from meshspeed.optim.no_optimizer import NoOptimizer
from meshspeed.optim.precision import build_scaler
from meshspeed.optim.schedulers import build_scheduler
from meshspeed.parallel import registry
from meshspeed.parallel.activation_setup import configure_from_config
from meshspeed.parallel.data.onebit import apply_onebit
from meshspeed.parallel.pipeline.axis import apply_pp
from meshspeed.parallel.pipeline.module import PipelineModule
from meshspeed.parallel.protocol import HandsOver
from meshspeed.parallel.sharding import apply_dp
from meshspeed.parallel.zero.init_shards import cast_partitioned, check_initialised, is_partitioned
from meshspeed.process.accelerator import get_accelerator
from meshspeed.process.distributed import get_local_rank, get_local_world_size, init_distributed
from meshspeed.process.malloc import tune_host_allocator
from meshspeed.process.speak import speak
from meshspeed.sequence.axis import apply_cp
from meshspeed.tensor_parallel.axis import apply_tp

__all__ = ["build", "run_features"]

log = logging.getLogger("meshspeed")


def build(model: nn.Module, config: Any = None, *, optimizer: Any = None, model_parameters: Any = None,
          training_data: Any = None, lr_scheduler: Any = None, mpu: Any = None, mesh_param: Any = None,
          collate_fn: Any = None, dataloader_seed: int = 0,
          engine_types: tuple[type, type] = (MeshspeedEngine, PipelineEngine)):
    """`(engine, optimizer, dataloader, lr_scheduler)` for `model` under `config` (a path, a
    dict, a MeshspeedConfig or None). `engine_types`: the (plain, pipelined) engine classes
    to build, e.g. the DeepSpeed layer's, which add DeepSpeed's getters."""
    probe = start_probe(model)  # `meshspeed autotune`'s probe run: the model's facts, then exit
    init_distributed()  # or adopt the caller's group: Note [a process group the caller made]
    device = get_accelerator().device(get_local_rank())
    if device.type == "cpu":
        tune_host_allocator()  # Note [a fixed mmap threshold for CPU training]
    cfg = load_config(config, dp_world_size=None)  # parsed once; the batch triad waits for the mesh
    speak(cfg.log_level)  # Note [meshspeed's own handler]
    mesh_degrees = mesh_param_degrees(mesh_param)
    degrees = requested_degrees(cfg, model, mesh_degrees)
    check(run_features(cfg, degrees, model, mpu))  # Note [one composition table]
    mesh = build_layout(cfg, degrees, mpu, device, model, mesh_degrees)
    cfg = load_config(cfg, dp_world_size=mesh.size("dp"), dp_source=describe_layout(mesh))
    if mesh.size("cp") > cfg.sequence.size:  # the degree came from mesh_param: Ulysses
        cfg = cfg.model_copy(update={"sequence_parallel_size": mesh.size("cp")})
    report_no_effect(cfg, rank=comm.get_rank())
    comm.set_timeout(cfg.comms_timeout)  # a wait longer than this is a CommTimeoutError
    check_offload(cfg, client_optimizer=optimizer)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    _check_trainable(model)
    _take_over(model)  # Note [a second engine on one model]
    check_initialised(model)  # Note [initialised after the build]
    client_groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else None
    selection = ParamSelection.capture(client_groups or model_parameters, model)

    pipeline = apply_pp(model, mesh, cfg) if isinstance(model, PipelineModule) else None
    if pipeline is not None:  # a rebind may bring layers listed on another stage: Note [model_parameters by name]
        selection = selection.joined(comm.all_gather_object(selection.named, group=mesh.group("pp")), model)
        selection.keep_frozen(model)
    params = whole_param_count(model, mesh)  # for the banner, before tp splits the layers
    tp = apply_tp(model, mesh, cfg)
    context = apply_cp(model, mesh, cfg)
    module = _cast(model, device, cfg.precision_dtype)
    if pipeline is not None:
        pipeline.tie()  # collective: every rank makes the tied groups
    # ZeRO-Infinity's unset buffer settings, from the units about to be built (offload/auto.py)
    cfg = choose_unset_knobs(cfg, module, mesh.size("dp_cp"), on_cpu=device.type == "cpu")
    placement = offload_placement(cfg)
    experts = apply_ep(module, mesh, cfg, device)
    strategy = apply_dp(module, mesh, cfg, placement=placement, experts=experts,
                        local_ranks=get_local_world_size())
    configure_from_config(cfg, mesh)  # the activation_checkpointing block, with the tp group
    check_host_memory(strategy, cfg)
    opt = _optimizer(cfg, optimizer, selection, module, strategy, placement, mesh)
    apply_onebit(opt, strategy)
    registry.attach_optimizer(strategy, opt)  # for safe_get_full_optimizer_state(param, key)
    scheduler = _scheduler(cfg, lr_scheduler, opt)
    compression = apply_compression(module, mesh, cfg)
    if compression is None:  # (compression's step hooks edit weights around the step)
        enable_update_in_backward(cfg, mesh, opt, placement, experts)

    loader = None
    if training_data is not None:
        loader = distributed_dataloader(
            training_data, cfg.train_micro_batch_size_per_gpu, dp_rank=mesh.coord("dp"),
            dp_size=mesh.size("dp"), seed=dataloader_seed, collate_fn=collate_fn,
            shuffle=pipeline is None,  # DeepSpeed's PipelineEngine reads training_data in order
        )
    step_parts = [tp] + ([pipeline] if pipeline is not None else [])
    if not cfg.zero_optimization.ignore_unused_parameters:
        step_parts.append(UnusedParameterCheck(module))
    parts = Composed(
        module=module, config=cfg, mesh=mesh, strategy=strategy, optimizer=opt, scaler=build_scaler(cfg.fp16),
        device=device, lr_scheduler=scheduler, dataloader=loader, comm_logger=_comm_logger(cfg),
        forward=context, step_parts=step_parts,
        callbacks=[compression] if compression is not None else [])
    engine = engine_types[pipeline is not None](parts)
    if probe is not None:
        probe.watch(module)  # the first forward gives the sequence length and ends the probe
    if cfg.checkpoint.auto_resume and cfg.checkpoint.dir is not None:
        engine.load_checkpoint(cfg.checkpoint.dir)  # Note [what auto_resume loads]: None on a first run
    lines = banner_lines(engine, params)  # every rank: memory_breakdown may gather
    if comm.get_rank() == 0:
        for line in lines:
            log.info("%s", line)
    return engine, opt, loader, scheduler


def run_features(cfg: MeshspeedConfig, degrees: dict[str, int], model: nn.Module, mpu: Any) -> dict[str, str]:
    """The features of this run for the composition table: the config's, and those the
    model, the degrees and the call decide (Note [one composition table])."""
    out = config_features(cfg)
    out.pop("tp", None)
    out.pop("cp", None)
    if degrees["tp"] > 1:
        out["tp"] = f"tensor parallelism (tensor_parallel.autotp_size {degrees['tp']})"
    if degrees["cp"] > 1:
        out["cp"] = f"context parallelism (size {degrees['cp']})"
    if isinstance(model, PipelineModule):
        out["pp"] = f"a {model.num_stages}-stage PipelineModule"
        if any(len(stages) > 1 for stages in model.tied_stages().values()):
            out["tied_stages"] = FEATURES["tied_stages"]
    if degrees["ep"] > 1:
        out["ep"] = f"expert parallelism (MoE ep_size {degrees['ep']})"
    layers = expert_layers(model)
    if layers:
        out["moe"] = f"MoE layers ({layers[0][0]!r}, ...)"
    if any(is_partitioned(p) for p in model.parameters()):
        out["zero_init"] = FEATURES["zero_init"]
    if mpu is not None:
        out["mpu"] = FEATURES["mpu"]
    return out


# Note [a second engine on one model]
# Scripts call initialize again on a model an earlier engine still holds (DeepSpeed's tests
# load a checkpoint into a fresh engine on the same module; Hugging Face re-initializes for
# evaluation). At stage 3 the earlier strategy left each parameter an empty placeholder and
# hooks on the modules. The new engine asks every earlier owner that can (HandsOver) to make
# the parameters whole plain tensors and remove its hooks, so it starts from the values the
# first one trained; the earlier engine then refuses to train, in one sentence.
def _take_over(model: nn.Module) -> None:
    owners = {}
    for p in model.parameters():
        owner = registry.owner_of(p)
        if isinstance(owner, HandsOver):
            owners.setdefault(id(owner), owner)
    for owner in owners.values():
        owner.hand_over()


def _check_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        count = sum(1 for _ in model.parameters())
        raise ValueError(f"initialize(model=...): {type(model).__name__} has no trainable parameters "
                         f"({count} parameters, all with requires_grad=False); unfreeze some "
                         "(p.requires_grad_(True)) or run the model without an engine for inference")


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


def _optimizer(cfg: MeshspeedConfig, client: Any, selection: ParamSelection, module: nn.Module, strategy,
               placement, mesh) -> torch.optim.Optimizer:
    groups = selection.groups(module, strategy.master_of)
    if client is not None:
        if cfg.optimizer is not None:
            raise ConfigError(["optimizer: given both in the config and as initialize(optimizer=...); keep one"])
        return adopt_client_optimizer(client, groups)
    if cfg.optimizer is None:  # Note [an engine without an optimizer]
        return NoOptimizer(groups)
    try:
        opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), groups, mesh.group("dp_cp"))
    except (ValueError, TypeError) as err:
        raise ConfigError([str(err)]) from err
    return offload_optimizer(opt, cfg, placement)


def _scheduler(cfg: MeshspeedConfig, client: Any, optimizer):
    if client is not None:  # a scheduler, or (DeepSpeed's rule) a callable that makes one
        return client(optimizer) if callable(client) and not isinstance(client, LRScheduler) else client
    if cfg.scheduler is None:
        return None
    try:
        return build_scheduler(optimizer, cfg.scheduler.type, dict(cfg.scheduler.params))
    except (ValueError, TypeError) as err:
        raise ConfigError([f"scheduler.params: {err}"]) from err


def _comm_logger(cfg: MeshspeedConfig):
    if not cfg.comms_logger.enabled:
        return None
    return comm.CommLogger.from_config(cfg.comms_logger).start()

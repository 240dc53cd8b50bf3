"""Offload at initialize: check the config, make the placement, wrap the optimizer.

`meshspeed.initialize` calls, in order:
  check_offload(cfg, client_optimizer)    -> ConfigError before anything is built
  choose_unset_knobs(cfg, module, dp)     -> ZeRO-Infinity's unset buffer settings (auto.py)
  offload_placement(cfg)                  -> an OffloadPlacement for Zero, or None
  check_host_memory(strategy, cfg)        -> ConfigError when the host cannot hold it
  offload_optimizer(optimizer, cfg, placement) -> the optimizer, or OffloadOptimizer
Each is the identity when the config offloads nothing.
"""

from __future__ import annotations

import functools
import logging

import torch

from meshspeed import comm
from meshspeed.config.errors import ConfigError
from meshspeed.offload.aio import SwapEngine
from meshspeed.offload.grad_files import GradFiles
from meshspeed.offload.hostmem import available_host_bytes, local_world_size
from meshspeed.offload.kernels import AdamRule, SgdRule
from meshspeed.offload.masters import MasterFiles
from meshspeed.offload.optimizer import OffloadOptimizer
from meshspeed.offload.param import HostShardStore, NvmeShardStore
from meshspeed.offload.placement import OffloadPlacement
from meshspeed.offload.residency import apply_residency, log_residency
from meshspeed.offload.space import bytes_to_write, check_swap_space, planned_files
from meshspeed.offload.state import HostStore, SwapStore
from meshspeed.offload.swapdir import check_nvme_path
from meshspeed.planner.offload import WRITES_IN_FLIGHT
from meshspeed.process.accelerator import get_accelerator
from meshspeed.process.distributed import get_local_rank

log = logging.getLogger("meshspeed")

_OO = "zero_optimization.offload_optimizer"
_OP = "zero_optimization.offload_param"


def _devices(cfg) -> tuple[str, str]:
    z = cfg.zero_optimization
    oo = z.offload_optimizer.device if z.offload_optimizer is not None else "none"
    # below stage 3 parameters are whole on every rank: offload_param has no effect there,
    # as in DeepSpeed (check_offload says so once)
    op = z.offload_param.device if z.offload_param is not None and z.stage == 3 else "none"
    return oo, op


def offloads(cfg) -> bool:
    return _devices(cfg) != ("none", "none")


def check_offload(cfg, client_optimizer=None) -> None:
    """Raise ConfigError for offload settings that cannot run, on every rank together."""
    z = cfg.zero_optimization
    if z.offload_optimizer is None and z.offload_param is None:
        return  # the same on every rank: either all ranks agree below or none does
    if (z.offload_param is not None and z.offload_param.device != "none" and z.stage != 3
            and (not comm.is_initialized() or comm.get_rank() == 0)):
        log.warning("%s (device %r) has no effect at ZeRO stage %d: parameters are whole on "
                    "every rank below stage 3; training goes on without parameter offload "
                    "(set zero_optimization.stage to 3 to offload them)", _OP,
                    z.offload_param.device, z.stage)
    _agree(_problems(cfg, client_optimizer))


def _problems(cfg, client_optimizer) -> list[str]:
    z = cfg.zero_optimization
    oo, op = _devices(cfg)
    out = []
    if oo != "none" and z.stage == 0:
        out.append(f"{_OO}: needs ZeRO stage 1, 2 or 3 (got stage 0: every rank would step the "
                   "whole optimizer); set zero_optimization.stage")
    if op == "nvme" and oo == "none":
        out.append(f"{_OP}.device: \"nvme\" needs offload_optimizer (\"cpu\" or \"nvme\"): "
                   "the fp32 masters must live apart from the swapped shards")
    if op == "nvme":
        try:
            check_nvme_path(z.offload_param.nvme_path, f"{_OP}.nvme_path")
        except ConfigError as err:
            out.extend(err.problems)
    if oo == "none":
        if z.offload_optimizer is not None and z.offload_optimizer.delayed_update:
            out.append(f"{_OO}.delayed_update: needs device \"cpu\" or \"nvme\"")
        return out
    o = z.offload_optimizer
    if o.ratio != 1.0:
        out.append(f"{_OO}.ratio: only 1.0 (the whole step on the host) is implemented "
                   f"(got {o.ratio})")
    if oo == "nvme":
        try:
            check_nvme_path(o.nvme_path, f"{_OO}.nvme_path")
        except ConfigError as err:
            out.extend(err.problems)
    if client_optimizer is not None and (oo == "nvme" or o.delayed_update):
        out.append(f"{_OO}: a client optimizer (initialize(optimizer=...)) runs on host masters "
                   "with device \"cpu\" only; for \"nvme\" or delayed_update put the optimizer "
                   "in the config")
    if cfg.optimizer is not None and client_optimizer is None:
        params = dict(cfg.optimizer.params)
        if params.get("amsgrad"):
            out.append("optimizer.params.amsgrad: not supported with offload_optimizer")
        if oo == "nvme" and cfg.optimizer.type == "SGD":
            out.append(f"{_OO}.device: \"nvme\" supports Adam and AdamW; use \"cpu\" for SGD")
    return out


def _agree(problems: list[str]) -> None:
    """Every rank raises if any rank found a problem (a rank that went on alone would
    wait forever in the strategy's first collective)."""
    flag = torch.tensor(1.0 if problems else 0.0)
    if comm.is_initialized() and comm.get_world_size() > 1:
        flag = flag.to(get_device())  # NCCL reduces device tensors only
        comm.all_reduce(flag, op="max")
    if problems:
        raise ConfigError(problems)
    if flag.item():
        raise ConfigError([("zero_optimization: offload settings were refused on another rank "
                           "(its error says why); every rank stops")])


def get_device() -> torch.device:
    return get_accelerator().device(get_local_rank())


def _pin(cfg) -> bool:
    z = cfg.zero_optimization
    asked = any(t is not None and t.device != "none" and t.pin_memory
                for t in (z.offload_optimizer, z.offload_param))
    if asked and not get_accelerator().is_pin_available():
        log.info("offload: pin_memory has no effect without an accelerator")
    return asked and get_accelerator().is_pin_available()


def offload_placement(cfg) -> OffloadPlacement | None:
    """Where Zero keeps masters, their gradients and (stage 3) shards; None: on the device."""
    if not offloads(cfg):
        return None
    oo, op = _devices(cfg)
    o = cfg.zero_optimization.offload_optimizer
    return OffloadPlacement(device=get_device(), offload_optimizer=oo != "none",
                            offload_param=op, pin=_pin(cfg),
                            delayed=oo != "none" and o.delayed_update,
                            make_shard_store=_shard_store_factory(cfg, op),
                            make_master_files=_master_files_factory(cfg, oo),
                            make_grad_files=_grad_files_factory(cfg, oo))


def _swap_engine(cfg):
    a = cfg.aio
    return SwapEngine(block_size=a.block_size, queue_depth=a.queue_depth,
                      thread_count=a.thread_count, single_submit=a.single_submit,
                      overlap_events=a.overlap_events)


def _master_files_factory(cfg, oo: str):
    """NVMe optimizer offload keeps the fp32 masters in swap files too (masters.py)."""
    if oo != "nvme":
        return None
    o = cfg.zero_optimization.offload_optimizer
    return lambda placed: MasterFiles(placed.swap_dir(o.nvme_path).sub("masters"), _swap_engine(cfg))


def _grad_files_factory(cfg, oo: str):
    """Gradients of units whose masters are in files go to files too (grad_files.py)."""
    if oo != "nvme":
        return None
    o = cfg.zero_optimization.offload_optimizer
    return lambda placed, masters: GradFiles(placed.swap_dir(o.nvme_path).sub("grads"),
                                             _swap_engine(cfg), masters)


def _shard_store_factory(cfg, op: str):
    """How stage-3 shards are stored (param.py), or None when they stay on the device."""
    if op == "none":
        return None
    p = cfg.zero_optimization.offload_param
    if op == "cpu":
        return lambda placed, units: HostShardStore(units, pin=placed.pin)

    def make(placed, units):
        a = cfg.aio
        engine = SwapEngine(block_size=a.block_size, queue_depth=a.queue_depth,
                            thread_count=a.thread_count, single_submit=a.single_submit,
                            overlap_events=a.overlap_events)
        return NvmeShardStore(units, placed.swap_dir(p.nvme_path).sub("params"), engine,
                              buffer_count=p.buffer_count, buffer_numel=p.buffer_size,
                              pin=placed.pin)

    return make


def check_host_memory(strategy, cfg) -> None:
    """Pain point 19: fail at initialize, with numbers, rather than when the host OOMs."""
    tier = _devices(cfg)[0]
    if tier == "none":
        return
    owned = sum(u.shard_numel for u in strategy.units)
    if tier == "cpu":  # fp32 grads, masters and Adam's state, all in memory
        need = owned * 16
    else:  # on NVMe: the bounded buffers (Note [what an everything-on-NVMe rank holds])
        need = _nvme_buffers(strategy, cfg)
    free = available_host_bytes()
    problems = []
    if free is not None and need * local_world_size() > free:
        fix = ("use device \"nvme\", more hosts, or a larger ZeRO degree" if tier == "cpu" else
               "lower zero_optimization.sub_group_size, offload_optimizer.buffer_count or "
               "offload_param.buffer_count / buffer_size")
        problems.append(f"{_OO}: the {local_world_size()} rank(s) on this host need about "
                        f"{need * local_world_size() / 2**30:.1f} GiB of host memory for "
                        f"offloaded state{' buffers' if tier == 'nvme' else ''}, "
                        f"{free / 2**30:.1f} GiB is available; {fix}")
    _agree(problems)
    apply_residency(strategy, cfg, need, free)  # Note [the residency budget] in residency.py


def _nvme_buffers(strategy, cfg) -> int:
    """Host bytes of one rank with the optimizer on NVMe: the optimizer's swap pool, the
    parameter staging pool, the largest unit's gradient on its way to its file and the
    writes in flight (meshspeed/planner/offload.py names the same terms)."""
    z = cfg.zero_optimization
    largest_slice = max((s.numel for u in strategy.units for s in u.spans), default=0)
    owned = sum(u.shard_numel for u in strategy.units)
    sub_group = max(min(z.sub_group_size, owned), largest_slice)
    need = z.offload_optimizer.buffer_count * sub_group * 4 + WRITES_IN_FLIGHT
    need += 6 * max((u.shard_numel for u in strategy.units), default=0)  # 16-bit shard + fp32 copy
    p = z.offload_param
    if p is not None and p.device == "nvme" and z.stage == 3:
        need += p.buffer_count * p.buffer_size * 2
    return need


def offload_optimizer(optimizer: torch.optim.Optimizer, cfg, placement: OffloadPlacement | None):
    """The config's optimizer rebuilt as an `OffloadOptimizer` over the host masters."""
    if placement is None or not placement.offload_optimizer:
        return optimizer
    z = cfg.zero_optimization
    o = z.offload_optimizer
    rule = _rule(optimizer)
    if o.device == "cpu":
        def make_store(sub_groups):
            return HostStore(rule, placement.pin)
    else:
        def make_store(sub_groups):
            return _swap_store(rule, sub_groups, cfg, placement)

    return OffloadOptimizer(optimizer, rule, make_store, sub_group_size=z.sub_group_size,
                            runner=placement.runner)


def update_in_backward_allowed(cfg, mesh, optimizer, placement, experts) -> str | None:
    """Why the update cannot run during the backward (Note [the update during the
    backward] in optimizer.py), or None when it can: only what the gradient files hold may
    decide a sub-group's update, so nothing in `step()` may change the gradients first."""
    z = cfg.zero_optimization
    o = z.offload_optimizer
    if not isinstance(optimizer, OffloadOptimizer) or placement is None or placement.grad_files is None:
        return "the gradients are not in files"
    reasons = [(not o.update_in_backward, "offload_optimizer.update_in_backward is false"),
               (z.stage != 3, "it is built for stage 3"),
               (cfg.gradient_clipping > 0, "gradient_clipping needs the global norm first"),
               (cfg.fp16.enabled, "fp16 unscales and checks for overflow first"),
               (cfg.check_finite, "check_finite checks every gradient first"),
               (o.ratio < 1.0, "offload_optimizer.ratio < 1 splits the step"),
               (mesh.size("pp") > 1 or mesh.size("tp") > 1, "pipeline and tensor parallelism edit gradients first"),
               (experts is not None, "expert parallelism")]
    return next((why for bad, why in reasons if bad), None)


def enable_update_in_backward(cfg, mesh, optimizer, placement, experts) -> bool:
    """Turn the update during the backward on where it is allowed; logs why not on rank 0
    when the user asked for NVMe and it stays off for a reason of the config."""
    why = update_in_backward_allowed(cfg, mesh, optimizer, placement, experts)
    if why is not None:
        if placement is not None and placement.grad_files is not None and \
                cfg.zero_optimization.offload_optimizer.update_in_backward:
            log.info("ZeRO-Infinity: the optimizer updates after the backward, not during it: %s", why)
        return False
    files = placement.master_files
    into_forward = cfg.zero_optimization.offload_optimizer.update_into_forward
    optimizer.update_in_backward(files, into_forward=into_forward)
    placement.on_grads_landed = optimizer.grads_landed
    if into_forward:  # Note [the update that runs into the next forward] in optimizer.py
        placement.finish_updates = optimizer.finish_carried
        for u, unit in enumerate(files.units):
            unit.before_gather = functools.partial(_before_gather, optimizer, u)
    return True


def _before_gather(optimizer, u: int, unit, block: bool) -> bool:
    return optimizer.before_gather(u, block)


def _rule(optimizer: torch.optim.Optimizer):
    d = optimizer.defaults
    fused = d.get("fused")
    fused = not d.get("foreach") if fused is None else bool(fused)  # default: fused
    if isinstance(optimizer, torch.optim.SGD):
        momentum = any(g["momentum"] != 0 for g in optimizer.param_groups)
        return SgdRule(momentum=momentum, fused=fused)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay"))
        return AdamRule(decoupled=decoupled, fused=fused)
    raise ConfigError([f"{_OO}: {type(optimizer).__name__} cannot be offloaded (Adam, AdamW, SGD)"])


def _swap_store(rule, sub_groups, cfg, placement):
    o = cfg.zero_optimization.offload_optimizer
    a = cfg.aio
    swapdir = placement.swap_dir(o.nvme_path)
    engine = SwapEngine(block_size=a.block_size, queue_depth=a.queue_depth,
                        thread_count=a.thread_count, single_submit=a.single_submit,
                        overlap_events=a.overlap_events)
    store = SwapStore(rule, sub_groups, swapdir.sub("optimizer"), engine,
                      buffer_count=o.buffer_count, pin=placement.pin, preallocate=False,
                      masters=placement.master_files, grads=placement.grad_files,
                      resident_numel=getattr(placement, "residency", None) and placement.residency.optimizer_elements)
    # Note [room for the files the first step writes] in space.py
    _agree(check_swap_space(store.dir, bytes_to_write(planned_files(store)), f"{_OO}.nvme_path"))
    if not o.fast_init:
        store.preallocate()
    if getattr(placement, "residency", None) is not None:
        log_residency(placement.residency, store)
    store.owner = swapdir  # the directory lives as long as the store
    return store

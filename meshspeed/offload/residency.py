"""How much offloaded state stays in host memory: the budget, its split, and applying it.

Note [the residency budget]
With everything on NVMe, a rank's host memory holds bounded buffers (Note [what an
everything-on-NVMe rank holds] in meshspeed/planner/offload.py) and the machine's other
free memory sits idle. Part of the state can live there instead, and every byte of it
is a byte the step no longer reads or writes:

  16-bit shard, resident   2 B of memory (bf16/fp16) saves 6 B of I/O a step: read for
                           forward, read again for backward, written by the step
  optimizer sub-group      master (4 B) + two Adam moments (8 B) = 12 B saves 24 B a step
                           (each read and written once; the gradient stays in its file)
  shard kept fwd -> bwd    2 B saves up to 4 B (Note [resident shards and shards kept from
                           forward to backward] in meshspeed/offload/param.py)

so the budget goes to shards first (3 B of I/O per byte of memory), then to optimizer
sub-groups (2 B per byte), and what is left to the keep cache. The user's limits are
`offload_param.max_in_cpu` (DeepSpeed's key) and `offload_optimizer.max_in_cpu`
(meshspeed's), in elements; a value the user sets is kept as it is. An unset limit is
filled from the budget: the peak a rank aims at, min(8 GiB, half of MemAvailable shared by
the ranks on this host) -- the same target the buffer defaults aim at (Note [defaults that
fit] in meshspeed/planner/nvme_defaults.py) -- less the training peak (the buffers
`check_host_memory` counts and, on a CPU-only machine, the gradient staging and gathered
parameters the accelerator would hold), the interpreter and 1 GiB for what the count
leaves out (activations, heap fragmentation; the 2B run peaked 0.9 GiB above its buffers
and interpreter). The other half of MemAvailable is headroom: MemAvailable counts page
cache as reclaimable, and the swap files' buffered writes refill that cache during the
step. Issue 33 asks both for residency from MemAvailable and for the 2B model to train at
<= 8 GiB per process with the tutorial's config; on a 24 GiB machine the two meet only
under this cap. On a 2B model the buffers take most of the 8 GiB and little is left to
hold; on a 0.3B model all of its state fits. A user who grants more memory sets the two
`max_in_cpu` keys.
DeepSpeed's default for `max_in_cpu`, 1e9, is not taken for a limit when the key is unset.

Residency moves bytes only: a resident shard, master or moment holds the same bits its
file would, so losses and parameters are bit-identical to a budget of 0
(tests/offload/test_residency.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from meshspeed import comm
from meshspeed.offload.hostmem import available_host_bytes, local_world_size
from meshspeed.planner.fit import INTERPRETER
from meshspeed.planner.nvme_defaults import PEAK_CAP, SHARE

log = logging.getLogger("meshspeed")

UNCOUNTED = 1 << 30  # activations and fragmentation, above the counted buffers (2B: 0.9 GiB)
OPTIMIZER_BYTES = 12  # per resident optimizer element: fp32 master + exp_avg + exp_avg_sq


def residency_budget(peak_bytes: int, available: int | None = None,
                     local_ranks: int | None = None) -> int:
    """Host bytes one rank may fill with resident state (Note [the residency budget]):
    the peak a rank aims at (from its share of `available`, MemAvailable when None) above
    `peak_bytes`, the interpreter and what neither counts."""
    if available is None:
        available = available_host_bytes()
    if available is None:
        return 0  # MemAvailable unknown: keep nothing resident rather than guess
    share = available // (local_ranks or local_world_size())
    target = min(PEAK_CAP, int(SHARE * share))  # the peak the buffer defaults aim at
    return max(0, int(target - INTERPRETER - UNCOUNTED - peak_bytes))


@dataclass
class ResidencyPlan:
    """Limits in effect: elements of shards and of optimizer sub-groups kept in memory,
    and bytes of the forward-to-backward keep cache."""

    param_elements: int = 0
    optimizer_elements: int = 0
    keep_bytes: int = 0
    budget: int = 0  # what the plan was split from (the user's limits may exceed it)
    units: int = 0  # filled in when applied: units whose shards are resident
    shard_bytes: int = 0  # and their bytes
    chosen: tuple[str, ...] = ()  # the limits taken from the budget (the user left them unset)


def split_budget(budget: int, *, shard_elements: int, shard_bytes: int, optimizer_elements: int,
                 param_limit: int | None, optimizer_limit: int | None) -> ResidencyPlan:
    """Shards first, then optimizer sub-groups, then the keep cache (Note [the residency
    budget]). `param_limit` / `optimizer_limit`: the user's value, kept, or None."""
    left = max(0, budget)
    param = param_limit if param_limit is not None else min(shard_elements, left // max(1, shard_bytes))
    left -= min(param, shard_elements) * shard_bytes
    opt = optimizer_limit if optimizer_limit is not None else \
        min(optimizer_elements, max(0, left) // OPTIMIZER_BYTES)
    left -= min(opt, optimizer_elements) * OPTIMIZER_BYTES
    on_disk = max(0, shard_elements - param) * shard_bytes
    chosen = tuple(k for k, v in (("offload_param.max_in_cpu", param_limit),
                                  ("offload_optimizer.max_in_cpu", optimizer_limit)) if v is None)
    return ResidencyPlan(param, opt, min(max(0, left), on_disk), budget=max(0, budget), chosen=chosen)


def user_limits(cfg) -> tuple[int | None, int | None]:
    """(offload_param.max_in_cpu, offload_optimizer.max_in_cpu) where the user set them."""
    z = cfg.zero_optimization
    p, o = z.offload_param, z.offload_optimizer
    param = p.max_in_cpu if p is not None and "max_in_cpu" in p.model_fields_set else None
    opt = o.max_in_cpu if o is not None else None
    return param, opt


def apply_residency(strategy, cfg, peak_bytes: int, available: int | None) -> ResidencyPlan | None:
    """Choose the plan for this rank and give it to the shard store and (through the
    placement) to the optimizer's swap store; logs the choice on rank 0."""
    placement = getattr(strategy, "placement", None)
    store = getattr(placement, "shard_store", None)
    store = store if getattr(store, "tier", None) == "nvme" else None
    masters = getattr(placement, "master_files", None)
    if store is None and masters is None:
        return None
    shard_elements = sum(store.numel) if store is not None else 0
    shard_bytes = max((d.itemsize for d in store.dtype), default=2) if store is not None else 2
    owned = sum(u.shard_numel for u in strategy.units) if masters is not None else 0
    param_limit, opt_limit = user_limits(cfg)
    budget = residency_budget(peak_bytes + _compute_side(strategy, cfg, placement), available)
    plan = split_budget(budget, shard_elements=shard_elements, shard_bytes=shard_bytes,
                        optimizer_elements=owned, param_limit=param_limit, optimizer_limit=opt_limit)
    placement.residency = plan  # read by setup._swap_store, which logs it (log_residency)
    if store is not None:
        plan.units = len(store.make_resident(plan.param_elements))
        plan.shard_bytes = store.resident_nbytes()
        if param_limit is not None:  # the user's limit covers shards kept as well as resident
            left = max(0, param_limit - store.resident_elements())
            plan.keep_bytes = min(plan.keep_bytes, left * shard_bytes)
        store.keep(plan.keep_bytes)
    if masters is None:
        log_residency(plan, None)
    return plan


def _compute_side(strategy, cfg, placement) -> int:
    """On a CPU-only machine the accelerator's buffers are host memory too: ZeRO's gradient
    staging (the largest unit and two others, fp32, whole and 1/dp) and the gathered
    parameters (the largest unit and max_live + one prefetch bucket, 16-bit), as
    meshspeed/planner/offload.py counts them; 0 where they are on a device."""
    if getattr(getattr(placement, "device", None), "type", "cpu") != "cpu" or not strategy.units:
        return 0
    z = cfg.zero_optimization
    whole = sorted((u.shard_numel * getattr(u, "world", 1) for u in strategy.units), reverse=True)
    dp = max(getattr(strategy.units[0], "world", 1), 1)
    largest, rest = whole[0], sum(whole[1:])
    staging = (largest + sum(whole[1:3])) * 4 * (1 + 1 / dp)
    live = min(rest, max(whole[1] if len(whole) > 1 else 0,
                         z.stage3_max_live_parameters + z.stage3_prefetch_bucket_size))
    return int(staging + (largest + live) * 2)


def log_residency(plan: ResidencyPlan, swap_store) -> None:
    """The one line on rank 0 that says what stays in memory and what it saves."""
    groups, opt_bytes = (0, 0) if swap_store is None else swap_store.resident_summary()
    saved = 3 * plan.shard_bytes + 2 * opt_bytes + 2 * plan.keep_bytes
    if comm.is_initialized() and comm.get_rank() != 0:
        return
    why = (f"{' and '.join(plan.chosen)} from {plan.budget / 2**30:.2f} GiB that MemAvailable leaves "
           "above the training peak, within the 8 GiB a rank aims at" if plan.chosen else "as max_in_cpu set them")
    log.info("ZeRO-Infinity: keeping %d units' shards (%.2f GiB) and %d sub-groups' optimizer state "
             "(%.2f GiB) in memory, up to %.2f GiB of shards from forward to backward; %.2f GB/step "
             "of I/O saved (%s)", plan.units, plan.shard_bytes / 2**30, groups, opt_bytes / 2**30,
             plan.keep_bytes / 2**30, saved / 1e9, why)

"""ZeRO-Infinity at initialize: fill in the buffer settings the user left unset.

`choose_unset_knobs(cfg, module, dp)` runs before the strategy is built (the shard store,
the Fetcher and the optimizer read these settings as they are made). With stage 3 and
both offloads on "nvme" it reads the stage-3 units the strategy will build (their sizes,
from `module_units`, zero.Init's placeholders counted whole) and MemAvailable shared among
the host's ranks, and calls `meshspeed.planner.nvme_defaults.choose` (Note [defaults that
fit]), the function `meshspeed estimate` calls. A setting is the user's when it is in the
config's `model_fields_set` (DeepSpeed's spellings, `max_live_parameters` for
`stage3_max_live_parameters`, are renamed before validation, so they count as set too).
Rank 0 logs the choice in one line; when nothing fits, every rank raises a ConfigError
that names the setting to lower.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from meshspeed import comm
from meshspeed.config.errors import ConfigError
from meshspeed.offload.hostmem import available_host_bytes
from meshspeed.parallel.zero.external import external_uses
from meshspeed.parallel.zero.grouping import block_modules, module_units
from meshspeed.parallel.zero.init_shards import full_numel
from meshspeed.planner.nvme_defaults import KEYS, choose, format_choice
from meshspeed.planner.offload import UnitSizes
from meshspeed.process.accelerator import get_accelerator
from meshspeed.process.distributed import get_local_rank, get_local_world_size

log = logging.getLogger("meshspeed")


def infinity(cfg) -> bool:
    """Stage 3 with the optimizer and the parameters on NVMe: ZeRO-Infinity."""
    z = cfg.zero_optimization
    return (z.stage == 3 and z.offload_optimizer is not None and z.offload_param is not None
            and z.offload_optimizer.device == "nvme" and z.offload_param.device == "nvme")


def given(cfg) -> dict[str, int]:
    """The settings of nvme_defaults.KEYS that the config sets, by key."""
    z = cfg.zero_optimization
    sections = {"": z, "offload_optimizer.": z.offload_optimizer, "offload_param.": z.offload_param}
    out = {}
    for key in KEYS:
        prefix, _, name = key.rpartition(".")
        section = sections[f"{prefix}." if prefix else ""]
        if name in section.model_fields_set:
            out[key] = getattr(section, name)
    return out


def unit_sizes(module: nn.Module, persistence_threshold: int) -> UnitSizes:
    """The sizes of the stage-3 units `Zero` will build from `module` (grouping.py)."""
    plan = module_units(module, persistence_threshold, numel=full_numel,
                        external=external_uses(module))
    block_names = {name for name, _ in block_modules(module)}
    blocks = [[full_numel(p) for _, p in u.params] for u in plan.units
              if u.shard_params and u.name.removesuffix(".experts") in block_names]
    # outside the blocks: the root and, split from it, the embedding's and the head's units
    # (Note [the root unit split] in meshspeed/parallel/zero/grouping.py)
    outer = [[full_numel(p) for _, p in u.params] for u in plan.units
             if u.shard_params and u.name.removesuffix(".experts") not in block_names]
    root = [n for u in outer for n in u]
    return UnitSizes(root=sum(root), block=max(map(sum, blocks), default=0),
                     n_blocks=len(blocks), root_param=max(root, default=0),
                     block_param=max((n for b in blocks for n in b), default=0),
                     outer=max(map(sum, outer), default=0))


def choose_unset_knobs(cfg, module: nn.Module, dp: int, *, on_cpu: bool):
    """`cfg` with the unset ZeRO-Infinity buffer settings chosen (the same config when it
    is not ZeRO-Infinity or the user set them all)."""
    if not infinity(cfg):
        return cfg
    mine = given(cfg)
    if set(mine) == set(KEYS):
        return cfg
    z = cfg.zero_optimization
    sizes = unit_sizes(module, z.stage3_param_persistence_threshold)
    num_params = sum(full_numel(p) for p in module.parameters())
    choice = choose(sizes, dp, _available_per_rank(), mine, on_cpu=on_cpu, num_params=num_params,
                    param_bytes=_bytes(cfg.precision_dtype), comm_bytes=4)
    if not choice.fits:
        raise ConfigError([f"zero_optimization: {choice.problem}"])
    if not comm.is_initialized() or comm.get_rank() == 0:
        log.info(format_choice(choice))
    return cfg.model_copy(update={"zero_optimization": _updated(z, choice.values, choice.chosen)})


def _updated(z, values: dict[str, int], chosen: tuple[str, ...]):
    top = {k: values[k] for k in chosen if "." not in k}
    sub: dict[str, dict[str, int]] = {}
    for k in chosen:
        if "." in k:
            section, name = k.split(".")
            sub.setdefault(section, {})[name] = values[k]
    for section, fields in sub.items():
        top[section] = getattr(z, section).model_copy(update=fields)
    return z.model_copy(update=top)


def _available_per_rank() -> int | None:
    """MemAvailable over the host's ranks, the least any rank read: every rank must make
    the same choice (a sub_group_size that differed would split the optimizer differently)."""
    free = available_host_bytes()
    if comm.is_initialized() and comm.get_world_size() > 1:
        device = get_accelerator().device(get_local_rank())  # NCCL reduces device tensors only
        t = torch.tensor(float(-1 if free is None else free), dtype=torch.float64).to(device)
        comm.all_reduce(t, op="min")
        free = None if t.item() < 0 else int(t.item())
    return None if free is None else free // get_local_world_size()


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

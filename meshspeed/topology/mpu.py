"""A Topology from a Megatron-style `mpu` object, as `deepspeed.initialize(mpu=...)` takes.

An mpu answers `get_model_parallel_group()` / `get_data_parallel_group()` and their
`_rank()` / `_world_size()` functions (Megatron-LM's `parallel_state`, DeepSpeed's
examples); newer ones name the tensor axis `get_tensor_model_parallel_group` and add
`get_pipeline_model_parallel_group`. meshspeed takes those groups as they are (the
user's layout wins) and checks that they describe a whole world: tp x pp x dp ranks.
Axes the mpu does not name have size 1.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from meshspeed.topology.degrees import AXES, ParallelDims
from meshspeed.topology.mesh import Topology

_TP = ("get_tensor_model_parallel_group", "get_model_parallel_group")
_PP = ("get_pipeline_model_parallel_group", "get_pipe_parallel_group")
_DP = ("get_data_parallel_group",)


def _group(mpu: Any, names: tuple[str, ...], required: bool) -> Any:
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    if required:
        raise TypeError(f"initialize(mpu=...): {type(mpu).__name__} has no {' or '.join(names)}(); "
                        "an mpu needs get_model_parallel_group() and get_data_parallel_group() "
                        "(Megatron-LM's parallel_state has both)")
    return None


def _singleton_groups() -> dict[int, dist.ProcessGroup]:
    """One group per rank holding only that rank (for axes of size 1). Collective."""
    out = {}
    for r in range(dist.get_world_size()):  # every rank creates every group, in order
        out[r] = dist.new_group([r])
    return out


def topology_from_mpu(mpu: Any) -> Topology:
    """The Topology the mpu's groups describe. Collective (size-1 axes get groups)."""
    tp = _group(mpu, _TP, True)
    dp = _group(mpu, _DP, True)
    pp = _group(mpu, _PP, False)
    world, rank = dist.get_world_size(), dist.get_rank()
    size = {"tp": dist.get_world_size(tp), "dp": dist.get_world_size(dp),
            "pp": dist.get_world_size(pp) if pp is not None else 1}
    if size["tp"] * size["dp"] * size["pp"] != world:
        raise ValueError(f"initialize(mpu=...): tensor-parallel size {size['tp']} x data-parallel "
                         f"size {size['dp']} x pipeline size {size['pp']} is not the world size "
                         f"{world}; the mpu's groups must cover every rank exactly once")
    for fn, axis in (("get_model_parallel_world_size", "tp"), ("get_data_parallel_world_size", "dp")):
        said = getattr(mpu, fn, None)
        if callable(said) and said() != size[axis]:
            raise ValueError(f"initialize(mpu=...): mpu.{fn}() says {said()} but its {axis} group "
                             f"has {size[axis]} ranks")
    tp_ranks, dp_ranks = set(dist.get_process_group_ranks(tp)), set(dist.get_process_group_ranks(dp))
    if tp_ranks & dp_ranks != {rank}:
        raise ValueError(f"initialize(mpu=...): rank {rank}'s model-parallel group {sorted(tp_ranks)} "
                         f"and data-parallel group {sorted(dp_ranks)} share ranks "
                         f"{sorted(tp_ranks & dp_ranks)}; they must meet in this rank only "
                         "(each is one axis of a grid)")
    me = _singleton_groups()[rank]
    groups = {"tp": tp, "dp": dp, "pp": pp if pp is not None else me, "cp": me}
    groups["dp_cp"] = groups["edp"] = dp  # no context or expert axes from an mpu
    groups["ep"] = me
    if set(groups) != set(AXES):
        raise AssertionError("topology_from_mpu must give every axis a group")
    dims = ParallelDims(world, tp=size["tp"], pp=size["pp"])
    return Topology(dims, None, groups, rank, source="mpu")

"""DeepSpeed's `deepspeed.utils.groups` accessors, for scripts that call them.

meshspeed passes groups explicitly (engine.mesh); DeepSpeed scripts instead ask this
module for "the" sequence or data-parallel group after `initialize`. These functions
answer from the layout of the most recent `meshspeed.initialize` in this process (before
one, sizes are 1 and groups are an error saying so).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from meshspeed.topology.degrees import ParallelDims

_current: list[Any] = []  # [Topology] of the latest initialize


def set_layout(topology: Any) -> None:
    _current[:] = [topology]


def _topology(what: str):
    if not _current:
        raise KeyError(f"No {what} group found: call meshspeed.initialize first (the groups come "
                       "from its mesh)")
    return _current[0]


def _size(axis: str) -> int:
    return _current[0].size(axis) if _current else 1


def _rank(axis: str) -> int:
    return _current[0].coord(axis) if _current else 0


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    return _topology("sequence parallel").group("cp")


def _get_sequence_parallel_world_size() -> int:
    return _size("cp")


def _get_sequence_parallel_rank() -> int:
    return _rank("cp")


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return _topology("sequence data parallel").group("dp_cp")


def _get_sequence_data_parallel_world_size() -> int:
    return _size("dp_cp") if _current else dist.get_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _rank("dp_cp") if _current else dist.get_rank()


def _get_data_parallel_group() -> dist.ProcessGroup:
    return _topology("data parallel").group("dp") if _current else dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return _size("dp") if _current else dist.get_world_size()


def _get_data_parallel_rank() -> int:
    return _rank("dp") if _current else dist.get_rank()


def _get_model_parallel_world_size() -> int:
    return _size("tp")


def _get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def _get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _topology("tensor parallel").group("tp")


# -- expert parallelism: DeepSpeed names the groups by the layers' `group_name` ("ep_size_<n>");
# meshspeed's mesh has one ep axis, so the only name is that of its ep size
def _expert_topology(group_name: str):
    topology = _topology("expert parallel")
    want = f"ep_size_{topology.size('ep')}"
    if group_name != want:
        raise KeyError(f"No expert parallel group {group_name!r}: this run's MoE layers have "
                       f"{want!r} (meshspeed has one expert-parallel axis)")
    return topology


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _expert_topology(group_name).group("ep")


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _expert_topology(group_name).group("edp")


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    topology = _topology("expert parallel")
    return {f"ep_size_{topology.size('ep')}": topology.group("ep")}


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    topology = _topology("expert data parallel")
    return {f"ep_size_{topology.size('ep')}": topology.group("edp")}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert_topology(group_name).size("ep")


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert_topology(group_name).coord("ep")


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert_topology(group_name).size("edp")


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert_topology(group_name).coord("edp")


# -- DeepSpeed's rank arithmetic for the expert groups, from meshspeed's layout
class ExpertLayoutError(AssertionError, ValueError):
    """Degrees that do not tile the world (DeepSpeed asserts there)."""


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False
                               ) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, edp groups) as rank lists, meshspeed's layout (ParallelDims, the E + D
    order DeepSpeed uses by default) in DeepSpeed's order: data-parallel group by
    data-parallel group (pipeline stage, then tensor-parallel rank), its ep blocks in turn,
    then its edp groups by ep coordinate."""
    if use_data_before_expert_parallel_:
        raise ExpertLayoutError("_get_expert_parallel_ranks: use_data_before_expert_parallel_=True "
                                "(the D + E layout) is not meshspeed's layout; meshspeed places "
                                "each ep group on consecutive data-parallel ranks (E + D), so "
                                "leave it False.")
    try:
        dims = ParallelDims(world_size, tp=tensor_parallel_size_, pp=pipeline_parallel_size_,
                            ep=expert_parallel_size_)
    except ValueError as error:
        raise ExpertLayoutError(f"_get_expert_parallel_ranks: {error}") from None
    ep, edp = [], []
    for dp_ranks in dims.groups("dp"):  # sorted by first rank: pipeline stage, then tp rank
        ep += [dims.group_of("ep", r) for r in dp_ranks[::dims.ep]]
        edp += [dims.group_of("edp", r) for r in dp_ranks[:dims.ep]]
    return ep, edp

"""`deepspeed.comm`: DeepSpeed's communication module, over meshspeed.comm (the collectives)
and meshspeed.process.distributed (starting and ending the process group).

Every name of meshspeed.comm is here too (`deepspeed.comm.all_reduce`, `get_rank`, ...);
what DeepSpeed adds is the process-group life cycle, a few group queries and the
collectives whose DeepSpeed signatures differ from meshspeed's, under DeepSpeed's names.

Note [DeepSpeed's object collectives]
meshspeed's `all_gather_object(obj)` returns the list and `broadcast_object(obj, src)` the
value; DeepSpeed's, like torch.distributed's, fill a list the caller passes
(`all_gather_object(object_list, obj)`, `broadcast_object_list(object_list, src)`). Under
`deepspeed.comm` the DeepSpeed forms are the ones a script means, so this module's
`all_gather_object` is DeepSpeed's; meshspeed's stays at `meshspeed.comm`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshspeed import comm as _comm
from meshspeed.comm import *
from meshspeed.comm import __all__ as _collectives
from meshspeed.process.distributed import get_local_rank, init_distributed

__all__ = [*_collectives, "all_reduce_coalesced", "broadcast_object_list",  # noqa: PLE0604
           "destroy_process_group", "get_all_ranks_from_group", "get_global_rank", "get_local_rank",
           "get_world_group", "inference_all_reduce", "init_distributed", "is_available", "new_group"]


def destroy_process_group(group: Any = None) -> None:
    """End the default process group (or `group`), as torch.distributed does."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


def is_available() -> bool:
    """Whether torch was built with distributed support."""
    return dist.is_available()


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    """A process group of the global `ranks` (every rank when None; every rank of the world
    calls it, in the same order, whether or not it is in `ranks`, as in torch)."""
    return dist.new_group(ranks, **kwargs)


def get_world_group() -> Any:
    """The default process group (every rank)."""
    _need_process_group("get_world_group")
    return dist.group.WORLD


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of `group`'s member `group_rank` (the default group: the same number)."""
    _need_process_group("get_global_rank")
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return [get_global_rank(group, r) for r in range(_comm.get_world_size(group))]


def inference_all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                         async_op: bool = False) -> Any:
    """DeepSpeed's all-reduce for inference's tensor-parallel layers: `tensor` reduced in
    place across `group` (sum by default). DeepSpeed routes it to a shared-memory kernel on
    some CPUs; here it is the ordinary all-reduce, so every backend and dtype gives the same
    result. On a group of one it is returned as it is."""
    if _comm.get_world_size(group) <= 1:
        return tensor
    return _comm.all_reduce(tensor, group=group, op=op, async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = dist.ReduceOp.SUM, group: Any = None,
                         async_op: bool = False) -> Any:
    """Reduce every tensor of `tensors` in place across `group`, as one flat all-reduce per
    dtype and device. With `async_op` each tensor is reduced on its own, and the handle
    returned waits for all of them."""
    if async_op:
        return _Works([_comm.all_reduce(t, group=group, op=op, async_op=True) for t in tensors])
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        _comm.all_reduce(flat, group=group, op=op)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return None


class _Works:
    """One handle over several collectives' work handles."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """DeepSpeed's form (Note [DeepSpeed's object collectives]): `object_list[r]` becomes
    rank r's `obj`. `object_list` must have one entry per rank of `group`."""
    size = _comm.get_world_size(group)
    if not isinstance(object_list, list) or len(object_list) != size:
        raise ValueError(f"all_gather_object(object_list, obj): object_list must be a list of "
                         f"{size} entries (one per rank of the group), got "
                         f"{_describe(object_list)}")
    object_list[:] = _comm.all_gather_object(obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    """DeepSpeed's form (Note [DeepSpeed's object collectives]): every rank's `object_list`
    becomes rank `src`'s (src a global rank, as in torch); `device` is accepted and unused,
    the objects travel on the group's own device."""
    del device
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list(object_list, src): object_list must be a list, got "
                         f"{_describe(object_list)}")
    group_src = src if group is None else dist.get_group_rank(group, src)
    object_list[:] = _comm.broadcast_object(list(object_list), group_src, group=group)


def _describe(value: Any) -> str:
    return f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__


def _need_process_group(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"deepspeed.comm.{what}(): no process group yet; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize) first")


def __getattr__(name: str) -> Any:
    return getattr(_comm, name)

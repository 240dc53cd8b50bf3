"""The slices `zero.Init` leaves on each rank, until `meshspeed.initialize` takes them.

A parameter built under Init holds a placeholder of shape (0,) (touching it outside
`GatheredParameters` is an ordinary size error, as in DeepSpeed, never a read of freed
memory); its full shape and this rank's padded chunk (Note [per-parameter sharding] in
layout.py) are kept here, keyed by the parameter and held weakly by it. Between Init and
initialize the slices answer `GatheredParameters` (gather, publish a rank's changes,
release) and DeepSpeed's `ds_*` attributes (ds_params.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from meshspeed import comm
from meshspeed.parallel import registry
from meshspeed.parallel.protocol import ParameterOwner
from meshspeed.parallel.zero import ds_params
from meshspeed.parallel.zero.ds_params import PartitionView, ZeroParamStatus
from meshspeed.parallel.zero.layout import ParamLayout
from meshspeed.parallel.zero.replay import UninitialisedError


@dataclass
class _Slice:
    owner: InitShards  # held here: the owner lives as long as one of its parameters
    shape: torch.Size
    chunk: torch.Tensor | None  # this rank's padded chunk, 1-D (None: in the owner's file)
    gathered: bool = False  # whole now, for GatheredParameters
    dtype: torch.dtype | None = None
    numel: int = 0
    offset: int = -1  # where the chunk is in the owner's ChunkFile (init_spill.py)
    pending: str | None = None  # never written while built: Note [initialised after the build]

    def layout(self, world: int) -> ParamLayout:
        return ParamLayout("", tuple(self.shape), world, 0)

    def values(self) -> torch.Tensor:
        """The chunk (read back from its file when spilled: a copy)."""
        if self.chunk is not None:
            return self.chunk
        return self.owner.spill.get(self.offset, self.numel, self.dtype)

    def set_values(self, chunk: torch.Tensor) -> None:
        self.dtype, self.numel = chunk.dtype, chunk.numel()
        if self.owner.spill is None:
            self.chunk = chunk
        else:  # Note [building straight to NVMe] in init_spill.py
            self.chunk, self.offset = None, self.owner.spill.put(chunk)


# parameter -> its slice, for parameters built under Init; keyed by identity (a
# WeakKeyDictionary would compare tensors with ==, elementwise)
_SLICES: WeakIdKeyDictionary = WeakIdKeyDictionary()


class InitShards(ParameterOwner):
    """The owner (parallel/registry.py) of the parameters one `zero.Init` built."""

    def __init__(self, group, spill=None):
        self.group = group
        self.spill = spill  # a ChunkFile (init_spill.py) for remote_device="nvme", else None

    def adopt(self, param: nn.Parameter, full: torch.Tensor, dtype: torch.dtype, pending: str | None = None) -> None:
        """Keep this rank's chunk of `full` (param's values) and empty the parameter;
        `pending`: why its values are not yet real (Note [initialised after the build])."""
        world, rank = comm.get_world_size(self.group), comm.get_rank(self.group)
        layout = ParamLayout("", tuple(full.shape), world, 0)
        chunk = torch.zeros(layout.chunk, dtype=dtype)
        n = layout.valid(rank)
        chunk[:n].copy_(full.reshape(-1)[rank * layout.chunk : rank * layout.chunk + n])
        s = _SLICES[param] = _Slice(self, full.shape, None, pending=pending)
        s.set_values(chunk)
        param.data = _placeholder(dtype)
        registry.register([param], self)
        ds_params.expose([param], self)

    # -- GatheredParameters ---------------------------------------------------------------
    def gather_for_user(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        gathered = []
        for p in params:
            s = _SLICES.get(p)
            if s is not None and not s.gathered:
                p.data = _all_gather(s, self.group)
                s.gathered = True
                gathered.append(p)
        return gathered

    def publish_user_changes(self, params: list[nn.Parameter], src_rank: int) -> None:
        world, rank = comm.get_world_size(self.group), comm.get_rank(self.group)
        for p in params:
            s = _SLICES.get(p)
            if s is None or not s.gathered:
                continue
            comm.broadcast(p.data, src=src_rank, group=self.group)
            layout = s.layout(world)
            n = layout.valid(rank)
            chunk = s.values()
            chunk[:n].copy_(p.detach().reshape(-1)[rank * layout.chunk : rank * layout.chunk + n])
            if s.chunk is None:
                s.set_values(chunk)  # spilled: the changed chunk goes back to the file
            s.pending = None  # written whole by the modifier rank

    def release_for_user(self, gathered: list[nn.Parameter]) -> None:
        for p in gathered:
            s = _SLICES[p]
            s.gathered = False
            p.data = _placeholder(s.dtype)

    # -- ds attributes --------------------------------------------------------------------
    def partition_view(self, param: nn.Parameter) -> PartitionView:
        s = _SLICES[param]
        world, rank = comm.get_world_size(self.group), comm.get_rank(self.group)
        status = ZeroParamStatus.AVAILABLE if s.gathered else ZeroParamStatus.NOT_AVAILABLE
        # spilled: a copy read from the file (changing it changes nothing)
        return PartitionView(status, s.shape, s.values()[: s.layout(world).valid(rank)])


def is_partitioned(param: nn.Parameter) -> bool:
    return param in _SLICES


# Note [initialised after the build]
# Hugging Face builds a model under zero.Init with its init functions switched off
# (`no_init_weights`), then initialises each module's parameters inside
# `GatheredParameters(params, modifier_rank=0)` on rank 0 (transformers'
# `initialize_weights_zero3`), and from_pretrained loads weights the same way. A parameter
# that construction never (completely) wrote is therefore kept with zeros where it was not
# written and marked pending, and the mark goes when a GatheredParameters block with a
# modifier rank publishes its values. A parameter still pending when `meshspeed.initialize`
# takes the model raises UninitialisedError naming it: nothing unwritten is ever trained.


def check_initialised(module: nn.Module) -> None:
    """Raise UninitialisedError for the first parameter of `module` built under zero.Init
    whose values were never written (Note [initialised after the build])."""
    for name, p in module.named_parameters():
        s = _SLICES.get(p)
        if s is not None and s.pending is not None:
            raise UninitialisedError(
                f"zero.Init: parameter {name!r} of {type(module).__name__} is never completely initialised: "
                f"{s.pending}; initialise it in the module's constructor, reset_parameters() or the model's own "
                "init function, or write it inside GatheredParameters(params, modifier_rank=0) before "
                "meshspeed.initialize")


def full_shape(param: nn.Parameter) -> torch.Size:
    """The parameter's shape, also for one whose values are slices left by Init."""
    s = _SLICES.get(param)
    return param.shape if s is None else s.shape


def full_numel(param: nn.Parameter) -> int:
    return full_shape(param).numel()


def cast_partitioned(param: nn.Parameter, dtype: torch.dtype) -> None:
    s = _SLICES[param]
    s.set_values(s.values().to(dtype))
    param.data = _placeholder(dtype)


def gather_partitioned(param: nn.Parameter) -> None:
    """Make a parameter built under Init whole for good (all ranks call this together);
    it stops being Init's (its ds attributes go until a stage-3 strategy takes it)."""
    s = _SLICES.pop(param)
    param.data = _all_gather(s, s.owner.group).clone()  # the group the chunks were cut for
    ds_params.withdraw([param])


def _all_gather(s: _Slice, group) -> torch.Tensor:
    world = comm.get_world_size(group)
    chunk = s.values()
    full = torch.empty(world * chunk.numel(), dtype=chunk.dtype)
    comm.all_gather_into_tensor(full, chunk, group=group)
    return full[: s.shape.numel()].view(s.shape)


def _placeholder(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)

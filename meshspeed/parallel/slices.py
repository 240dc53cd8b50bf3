"""What each rank owns of each parameter: the contract between strategies and checkpoints.

A checkpoint never needs to know which stage produced it: every strategy describes its
state as, per parameter, a contiguous range of the flattened parameter that this rank
holds as an fp32 master tensor (plus the optimizer state of that tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshspeed.topology.shards import TPShard


@dataclass(frozen=True)
class OwnedSlice:
    name: str  # as in module.named_parameters() (a tied parameter appears once)
    shape: tuple[int, ...]  # the full LOCAL parameter's shape (under tp: this rank's piece)
    dtype: torch.dtype  # the dtype the model computes in
    start: int  # this rank's range [start, end) in the flattened full local parameter
    end: int
    master: torch.Tensor  # fp32, flat, end - start elements: the values the optimizer steps on
    key: nn.Parameter  # the tensor the optimizer holds (its state is keyed by it); same data
    writer: bool  # the one rank that writes this range (replicas skip it)
    requires_grad: bool
    # where the (local) parameter sits in the logical one under tensor parallelism; None:
    # not split (`shape` is then the logical shape). Strategies leave it None: the
    # checkpoint fills it from the layers' `tp_shards` (snapshot.ordered_slices).
    tp: TPShard | None = None
    # masters in swap files (meshspeed/offload/masters.py): `master` is then a placeholder
    # without memory and this reads (`read() -> flat fp32 copy`) / writes (`write(values)`)
    # the range; read masters through `master_values(slice)` (`deferred_master` to read later).
    swap: Any = None


def master_values(s: OwnedSlice) -> torch.Tensor:
    """The slice's fp32 master values (read from its swap file when it has one)."""
    return s.master if s.swap is None else s.swap.read()


@dataclass(frozen=True)
class Deferred:
    """A tensor that lives in a swap file: its dtype and shape now, its values when
    `read()` is called (a fresh copy each call). Checkpoints hold these instead of the
    values so that a rank's swapped state is in memory one tensor at a time."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


def deferred_master(s: OwnedSlice) -> torch.Tensor | Deferred:
    """The slice's fp32 masters: the tensor itself, or a Deferred when they are swapped."""
    return s.master if s.swap is None else Deferred(torch.float32, (s.end - s.start,), s.swap.read)


def deferred_state(state, key: nn.Parameter) -> dict[str, Any]:
    """`state[key]` of an optimizer, reading nothing from swap files: a state mapping with a
    `deferred(key)` method (meshspeed/offload/state.py `SwappedState`) returns its swapped
    tensors as Deferred; any other mapping returns its tensors."""
    deferred = getattr(state, "deferred", None)
    return deferred(key) if deferred is not None else state[key]


@dataclass(frozen=True)
class ParamAccess:
    """One parameter as its strategy holds it now, for user code that reads or writes its
    fp32 values, gradient or optimizer state (meshspeed/parallel/access.py)."""

    shape: torch.Size  # the full parameter's shape
    start: int  # this rank's range [start, end) of the flattened parameter
    end: int
    master: torch.Tensor  # fp32, flat, end - start elements: a view of the values stepped on
    key: nn.Parameter  # the tensor the optimizer holds for the range (its state's key)
    grad: torch.Tensor | None  # the range's reduced, averaged gradient (flat), or None
    sharded: bool  # whether the other ranges are on other ranks (else this rank holds all)
    group: Any  # the ranks holding the ranges, when sharded (None: the default group)
    publish: Callable[[], None]  # after writing `master`: the parameters follow (a
    #                              collective over `group` when sharded)
    # `grad` is this rank's whole, unreduced gradient (flat, the parameter's numel), read
    # before the step's reduction started (Note [local gradients before the reduction])
    local_grad: bool = False
    # `grad` is a copy (read from a swap file), so writing it changes nothing: setters refuse
    grad_is_copy: bool = False

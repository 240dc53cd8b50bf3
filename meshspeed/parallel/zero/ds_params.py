"""DeepSpeed's attributes of a partitioned parameter: `ds_id`, `ds_status`, `ds_shape`,
`ds_numel`, `ds_tensor`.

Client code written for DeepSpeed (Hugging Face's integration, DeepSpeed-Chat) asks a
parameter directly whether it is partitioned (`hasattr(p, "ds_id")`), whether it is
gathered now (`p.ds_status == ZeroParamStatus.NOT_AVAILABLE`) and what its full shape is.

Note [ds attributes are read through, not stored]
A partitioned parameter's class is switched (`p.__class__ = ...`) to a subclass of its
own class whose only additions are read-only properties; no value is stored on the
parameter. Each property asks the owner of the partition (the `zero.Init` slices before
`meshspeed.initialize`, the stage-3 strategy after) for its live state, so `ds_status`
is AVAILABLE exactly while the unit is whole (inside `GatheredParameters`, during the
module's forward) and `ds_tensor` is the rank's slice as it is now, never a stale copy
kept in sync at each transition. Why a subclass rather than attributes:
- the parameter stays an `nn.Parameter` of the same identity (optimizers, hooks,
  `named_parameters`, ties), and the subclass keeps torch's disabled `__torch_function__`,
  so ops on it cost nothing extra and return plain tensors;
- `state_dict` detaches (plain tensors), pickling rebuilds a plain `nn.Parameter`, and a
  copy (`copy.deepcopy`) is not registered: on all of them `hasattr(p, "ds_id")` is False;
- a parameter that stops being partitioned (gathered for stages 0-2) gets its class back,
  so `hasattr(p, "ds_id")` is False exactly when DeepSpeed's would be.

Owners implement `partition_view(param) -> PartitionView`.
"""

from __future__ import annotations

import enum
import itertools
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names (and values) for where a partitioned parameter's values are."""

    AVAILABLE = 1  # whole on this rank now
    NOT_AVAILABLE = 2  # only this rank's slice is resident
    INFLIGHT = 3  # an all-gather is under way


@dataclass(frozen=True)
class PartitionView:
    status: ZeroParamStatus
    shape: torch.Size  # the full parameter's shape
    local: torch.Tensor  # this rank's owned elements of the flattened parameter (1-D view)


# parameter -> (weak reference to its owner, the class it had before)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# parameter -> ds_id; kept when the owner changes (zero.Init -> initialize)
_IDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_next_id = itertools.count()
_CLASSES: dict[type, type] = {}  # parameter class -> its partitioned subclass


def _view(p) -> PartitionView:
    entry = _OWNERS.get(p)
    owner = None if entry is None else entry[0]()
    if owner is None:
        raise AttributeError("this parameter is not partitioned by ZeRO stage 3")
    return owner.partition_view(p)


class _PartitionedMixin:
    @property
    def ds_id(self) -> int:
        _view(self)
        return _IDS[self]

    @property
    def ds_status(self) -> ZeroParamStatus:
        return _view(self).status

    @property
    def ds_shape(self) -> torch.Size:
        return _view(self).shape

    @property
    def ds_numel(self) -> int:
        return math.prod(_view(self).shape)

    @property
    def ds_tensor(self) -> torch.Tensor:
        return _view(self).local


def _partitioned_class(cls: type) -> type:
    if issubclass(cls, _PartitionedMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_PartitionedMixin, cls), {"__module__": cls.__module__,
                                                                        "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def expose(params, owner) -> None:
    """Give `params` DeepSpeed's attributes, read from `owner.partition_view(param)`."""
    ref = weakref.ref(owner)
    for p in params:
        if not isinstance(p, nn.Parameter):
            continue
        entry = _OWNERS.get(p)
        base = type(p) if entry is None else entry[1]
        _OWNERS[p] = (ref, base)
        if p not in _IDS:
            _IDS[p] = next(_next_id)
        p.__class__ = _partitioned_class(base)


def withdraw(params) -> None:
    """The parameters are whole for good (stages 0-2): back to their own class."""
    for p in params:
        entry = _OWNERS.pop(p, None)
        if entry is not None:
            p.__class__ = entry[1]

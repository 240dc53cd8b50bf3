"""Which strategy owns a parameter (and which optimizer steps it), without storing anything
on the parameter itself.

Strategies register their parameters here; `meshspeed.zero.GatheredParameters` asks the
owner to gather, publish modifications and release. Keys are the parameters themselves,
held weakly and compared by identity (`id(param)` could be reused by a new parameter
after the old one died, and would then name the wrong owner); the owner is held weakly
too, so an entry goes with either.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(params: Iterable[nn.Parameter], owner: object) -> None:
    ref = weakref.ref(owner)
    for p in params:
        _OWNERS[p] = ref


def owner_of(param: nn.Parameter) -> object | None:
    ref = _OWNERS.get(param)
    return None if ref is None else ref()


# owner -> weak reference to the optimizer that steps its masters (set by initialize)
_OPTIMIZERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def attach_optimizer(owner: object, optimizer: object) -> None:
    _OPTIMIZERS[owner] = weakref.ref(optimizer)


def optimizer_of(param: nn.Parameter) -> object | None:
    """The optimizer stepping `param`'s master tensor(s), or None."""
    owner = owner_of(param)
    ref = None if owner is None else _OPTIMIZERS.get(owner)
    return None if ref is None else ref()

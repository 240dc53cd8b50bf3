"""Which strategy owns a parameter, without storing anything on the parameter itself.

Strategies register their parameters here; `meshspeed.zero.GatheredParameters` asks the
owner to gather, publish modifications and release. Entries disappear with their owner.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn

_OWNERS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def register(params: Iterable[nn.Parameter], owner: object) -> None:
    for p in params:
        _OWNERS[id(p)] = owner


def owner_of(param: nn.Parameter) -> object | None:
    return _OWNERS.get(id(param))

"""Callbacks that do not keep their owner alive.

Strategies install hooks on parameters and modules the user keeps; a hook holding the
strategy strongly would keep it (and, with offload, its swap files) alive for as long as
the model lives, or until a garbage-collector pass breaks the cycle. These hooks hold the
strategy weakly and do nothing once it is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any


def weak_method(method: Callable, *bound: Any) -> Callable:
    """`partial(method, *bound)` holding `method.__self__` weakly; returns None once it died."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        alive = ref()
        return None if alive is None else partial(alive, *bound)(*args, **kwargs)

    return call

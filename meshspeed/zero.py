"""`meshspeed.zero`: DeepSpeed's user-facing ZeRO helpers.

`GatheredParameters(params, modifier_rank=None)` makes parameters whole for the duration of
a `with` block (under stage 3 they are sharded otherwise); with `modifier_rank` set, the
values that rank holds at the end of the block are broadcast and become every rank's
parameters, shards and fp32 master weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from meshspeed.parallel.registry import owner_of
from meshspeed.parallel.zero.init import Init

__all__ = ["GatheredParameters", "Init"]


class GatheredParameters:
    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._owners: dict[int, tuple[object, list[nn.Parameter]]] = {}
        self._tokens: list[tuple[object, object]] = []

    def __enter__(self):
        if not self.enabled:
            return self
        for p in self.params:
            owner = owner_of(p)
            if owner is not None:
                self._owners.setdefault(id(owner), (owner, []))[1].append(p)
        for owner, params in self._owners.values():
            self._tokens.append((owner, owner.gather_for_user(params)))
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        for (owner, params), (_, token) in zip(self._owners.values(), self._tokens):
            if self.modifier_rank is not None and exc_type is None:
                owner.publish_user_changes(params, self.modifier_rank)
            owner.release_for_user(token)
        self._tokens.clear()
        return False

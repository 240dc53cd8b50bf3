"""Whole parameters for a while, whatever shards them: `with gathered(params): ...`.

Each parameter's owner (parallel/registry.py: a ZeRO strategy, the `zero.Init` slices, or
data parallelism, which holds them whole already) gathers its own on entry and releases
them on exit; with `modifier_rank`, the values that rank holds at the end of the block
become every rank's (parameters, shards and fp32 masters). The core's checkpoint export,
`engine.state_dict()` and the pipeline's weight pass use this; DeepSpeed's
`zero.GatheredParameters` is the same thing under DeepSpeed's name and signature
(meshspeed/compat/deepspeed/zero.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from meshspeed.parallel.registry import owner_of

__all__ = ["gathered"]


@contextlib.contextmanager
def gathered(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
             enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    owners: dict[int, tuple[object, list[nn.Parameter]]] = {}
    for p in params:
        owner = owner_of(p) if p is not None else None
        if owner is not None:
            owners.setdefault(id(owner), (owner, []))[1].append(p)
    tokens = []
    try:
        for owner, mine in owners.values():
            tokens.append((owner, mine, owner.gather_for_user(mine)))
        yield
        if modifier_rank is not None:
            for owner, mine, _ in tokens:
                owner.publish_user_changes(mine, modifier_rank)
    finally:
        for owner, _, token in tokens:
            owner.release_for_user(token)

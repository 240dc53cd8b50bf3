"""Bytes of the tensor storages a process holds, found by walking its live objects.

`StorageSampler.sample()` sums the distinct storages of every tensor reachable from
Python (parameters, their `.grad`, optimizer state, a strategy's buffers and pools),
wherever they hang: it measures what is really held, not what a strategy says it holds.
The parameters' `.grad` are added explicitly. Storages only C++ holds (autograd's saved
activations, a collective's internal scratch) are not visible, which is what a gradient-memory test wants: sample before backward and
from gradient hooks during it, and the growth is the gradient bytes held.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class StorageSampler:
    """`params`: also count their `.grad` (autograd keeps a gradient in C++, where the
    garbage collector's list of objects does not reach until Python asks for it)."""

    def __init__(self, params=()):
        self.params = list(params)
        self.samples: list[int] = []

    def live_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        grads = [p.grad for p in self.params if p.grad is not None]
        for obj in [*gc.get_objects(), *grads]:
            if type(obj) not in (torch.Tensor, nn.Parameter) or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    def sample(self) -> int:
        self.samples.append(self.live_bytes())
        return self.samples[-1]

    def hook_gradients(self) -> list:
        """Sample after each parameter's gradient is accumulated (hooks registered after
        the strategy's, so they see the state the strategy left)."""
        def hook(_param) -> None:
            self.sample()

        return [p.register_post_accumulate_grad_hook(hook) for p in self.params if p.requires_grad]

    @property
    def peak(self) -> int:
        return max(self.samples)


def saved_activation_bytes(fn: Callable, *args: Any, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes autograd keeps for backward while `fn(*args)` runs: the distinct storages of
    every tensor saved for backward (by torch's ops and by custom Functions such as
    `meshspeed.checkpointing.checkpoint`), seen through
    `torch.autograd.graph.saved_tensors_hooks`. The storages of `params` (default: `fn`'s
    parameters when it is a module) are left out: weights are held anyway, the question
    is what the activations cost. Nothing is kept after the call."""
    if params is None:
        params = fn.parameters() if isinstance(fn, nn.Module) else ()
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())

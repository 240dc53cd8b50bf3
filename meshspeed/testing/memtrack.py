"""Counting the bytes of tensors that operators allocate, as they are allocated and freed.

`LiveBytes` is a dispatch mode: every tensor an operator returns whose storage it has not
seen is counted until that tensor is garbage collected, and the peak of the running total
is kept. It sees what a strategy really allocates (gradients autograd produces, staging
and communication buffers made with torch.empty, ...) without asking the strategy.

A storage is counted from its first tensor and released when that tensor dies; a view
that outlives its base would be under-counted, so keep buffers as bases (pools do).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)

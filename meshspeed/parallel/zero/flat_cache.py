"""Note [gathered buffers without fresh pages]
On the CPU a stage-3 unit's flat buffer is freed at `release` and allocated again at the
next `gather` (Note [freeing storage, not swapping tensors] in flat.py). A block that large
is an mmap (Note [a fixed mmap threshold for CPU training]), so every gather writes into
fresh pages, and the kernel's first touch of a page costs more than the copy into it: on
the CI machine 200 MB copied into a new buffer took 0.12-0.24 s, into a used one 0.013 s.
A 2B model gathers 8 GB a step (forward and backward), most of it on the thread that
computes.

`FlatCache` keeps the most recently freed buffers, up to `budget_bytes`, and hands one of
the same size to the next gather: `release` moves the buffer's memory out of the unit's
storage into a spare storage object, and `gather` moves a spare's memory back in
(`UntypedStorage._swap_data_ptr_`, which exchanges two storages' memory and sizes). The
unit keeps its own storage object throughout, so the views autograd saved in forward see
the re-gathered values in backward, as with a resize. What a unit's buffer held before is
never read: the all-gather overwrites all of it.

The budget is the largest unit's buffer: a unit is released (after its module's forward,
or its backward) before the next prefetch is issued, so one spare serves the gathers of
equal-sized blocks in turn; past the budget the oldest spare is freed. The process holds
at most that much more than the live units during forward and backward, and nothing more
from `prepare_step` on: the strategy frees the spares there, before the optimizer's own
buffers are taken. On an accelerator the caching
allocator already reuses the memory, and the cache is off; it is off too where torch lacks
`_swap_data_ptr_`.
"""

from __future__ import annotations

import threading
from collections import deque

import torch


def available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class FlatCache:
    """Freed flat buffers, kept for the next gather of the same size."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._spares: deque[torch.UntypedStorage] = deque()  # oldest first
        self._lock = threading.Lock()  # (a save thread may gather while the trainer does)
        self.hits = 0  # gathers served from a spare (tests and reports)
        self.bytes = 0  # held by the spares

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty `storage` `nbytes` of memory: a spare's, else a new allocation."""
        with self._lock:
            for i, spare in enumerate(self._spares):
                if spare.nbytes() == nbytes:
                    del self._spares[i]
                    self.bytes -= nbytes
                    storage._swap_data_ptr_(spare)  # (`spare`, now empty, is dropped)
                    self.hits += 1
                    return
        storage.resize_(nbytes)

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory as a spare (the oldest spares freed past the budget);
        `storage` is left with none."""
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes > self.budget_bytes:
            storage.resize_(0)
            return
        spare = torch.UntypedStorage(0, device=storage.device)
        spare._swap_data_ptr_(storage)
        with self._lock:
            self._spares.append(spare)
            self.bytes += nbytes
            while self.bytes > self.budget_bytes:
                self.bytes -= self._spares.popleft().nbytes()

    def tensors(self) -> list[torch.Tensor]:
        """The spares as byte tensors (memory_breakdown: communication buffers)."""
        with self._lock:
            return [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s) for s in self._spares]

    def clear(self) -> None:
        """Free every spare (at each step: the spares serve a forward and its backward)."""
        with self._lock:
            self._spares.clear()
            self.bytes = 0

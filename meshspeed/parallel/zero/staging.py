"""Note [staging pool]
Stage 2 collects each unit's full gradients in a staging buffer while backward produces
them, reduce-scatters it and frees the per-parameter gradients. The buffers come from
this pool and go back once their reduction has landed, so a step allocates nothing after
the first, and the full-gradient bytes alive at once are the buffers out of the pool: the
unit being filled, the one reduction kept in flight, and any unit whose gradients arrive
interleaved with another's (a parameter used early and late in forward). A request is
served from the smallest free buffer large enough but at most `MAX_OVERSIZE` times the
request, else a new buffer is made (the pool grows to the most buffers ever out at once;
`high_water_bytes` says how much that was).

The size cap keeps buffers to requests of about their size (padding differs by a few
elements). Stage 3 stages the head's gradient first in backward and the embedding's last
(Note [the root unit split] in grouping.py). Were the blocks between them served from the
head's buffers (a 2B GPT's block is 0.75 of its head), the ones a block holds in flight
when the embedding's gradient lands could be those, and the embedding would make two
more: four vocabulary-sized buffers where two serve both. With the cap the blocks make
buffers of their own size and the embedding finds the head's free, so the pool is what
the units in flight of each size need at once.
"""

from __future__ import annotations

import torch

MAX_OVERSIZE = 1.25


class StagingPool:
    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.device = device
        self.free: list[torch.Tensor] = []
        self.out: dict[int, torch.Tensor] = {}  # id(view) -> its base buffer
        self.buffers: list[torch.Tensor] = []
        self.high_water_bytes = 0

    def take(self, numel: int) -> torch.Tensor:
        """A buffer view of `numel` elements (contents undefined)."""
        fits = [b for b in self.free if numel <= b.numel() <= MAX_OVERSIZE * numel]
        if fits:
            base = min(fits, key=lambda b: b.numel())
            self.free = [b for b in self.free if b is not base]  # (list.remove would compare values)
        else:
            base = torch.empty(numel, dtype=self.dtype, device=self.device)
            self.buffers.append(base)
        view = base[:numel]
        self.out[id(view)] = base
        self.high_water_bytes = max(self.high_water_bytes, self.out_bytes())
        return view

    def give_back(self, view: torch.Tensor) -> None:
        base = self.out.pop(id(view), None)
        if base is None:
            raise RuntimeError("staging pool: a buffer given back twice or not from this pool")
        self.free.append(base)

    def out_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.out.values())

    def tensors(self) -> list[torch.Tensor]:
        return list(self.buffers)

"""Grouping parameters into buckets bounded by element count; flat gradient buffers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def split_by_numel(items: Iterable[T], limit: int, numel=lambda item: item.numel()) -> list[list[T]]:
    """Consecutive runs of `items` holding at most `limit` elements each, as counted by
    `numel(item)` (a single larger item forms a bucket of its own)."""
    buckets: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        n = numel(item)
        if current and size + n > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        buckets.append(current)
    return buckets


def trainable(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.requires_grad]


class GradViews:
    """A flat gradient buffer whose slices are the `.grad` of a list of parameters.

    Autograd accumulates into an existing `.grad` in place, so micro-steps sum inside the
    buffer and one collective can reduce it whole (as DDP's gradient-as-bucket-view)."""

    def __init__(self, params: list[nn.Parameter], offsets, numel: int, dtype=None):
        self.params = list(params)
        self.offsets = list(offsets)
        p0 = self.params[0]
        self.flat = torch.zeros(numel, dtype=dtype or p0.dtype, device=p0.device)

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return buffer[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    def bind(self) -> None:
        """Zero the buffer and make each trainable parameter's .grad a view of it."""
        self.flat.zero_()
        for i, p in enumerate(self.params):
            if p.requires_grad:
                p.grad = self.view(self.flat, i)

    def collect(self) -> None:
        """Copy any gradient that autograd did not accumulate in place into the buffer."""
        for i, p in enumerate(self.params):
            view = self.view(self.flat, i)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

"""Grouping a sequence of parameters into buckets bounded by element count."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

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

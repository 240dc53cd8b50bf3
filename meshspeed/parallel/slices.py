"""What each rank owns of each parameter: the contract between strategies and checkpoints.

A checkpoint never needs to know which stage produced it: every strategy describes its
state as, per parameter, a contiguous range of the flattened parameter that this rank
holds as an fp32 master tensor (plus the optimizer state of that tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OwnedSlice:
    name: str  # as in module.named_parameters() (a tied parameter appears once)
    shape: tuple[int, ...]  # the full parameter's shape
    dtype: torch.dtype  # the dtype the model computes in
    start: int  # this rank's range [start, end) in the flattened full parameter
    end: int
    master: torch.Tensor  # fp32, flat, end - start elements: the values the optimizer steps on
    key: nn.Parameter  # the tensor the optimizer holds (its state is keyed by it); same data
    writer: bool  # the one rank that writes this range (replicas skip it)
    requires_grad: bool

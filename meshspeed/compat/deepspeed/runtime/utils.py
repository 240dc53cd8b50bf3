"""`meshspeed.runtime.utils`: the helpers DeepSpeed scripts call as `deepspeed.runtime.utils.X`."""

from __future__ import annotations

import gc
import itertools
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from meshspeed import comm
from meshspeed.compat.deepspeed.runtime._grad_norm import (
    clip_grad_norm_,
    get_global_norm,
    is_model_parallel_parameter,
)
from meshspeed.parallel.pipeline.partition import balanced_cuts
from meshspeed.process.accelerator import get_accelerator

__all__ = ["PartitionedTensor", "call_to_str", "clip_grad_norm_", "get_global_norm", "is_model_parallel_parameter",
           "partition_balanced", "partition_uniform", "prefix_sum_inc", "see_memory_usage", "set_random_seed"]

_GIB = 2**30


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (every device).

    NumPy takes 32-bit seeds and torch 64-bit ones; larger seeds are reduced modulo those
    ranges so that any integer a script passes is accepted."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)  # also seeds every CUDA device


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print device and host memory use under `message` on rank 0; only when `force`.

    Resets the device's peak counter afterwards, so consecutive calls report the peak of
    the stretch between them."""
    if not force:
        return

    if comm.is_initialized() and comm.get_rank() != 0:
        return
    gc.collect()  # drop unreachable tensors so that the figures are what is really held
    acc = get_accelerator()
    print(message)
    print(f"MA {acc.memory_allocated() / _GIB:.2f} GB  Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB  "
          f"CA {acc.memory_reserved() / _GIB:.2f} GB  Max_CA {acc.max_memory_reserved() / _GIB:.2f} GB")
    total, available = get_accelerator("cpu").total_memory(), get_accelerator("cpu").available_memory()
    used = total - available
    print(f"CPU Virtual Memory:  used = {used / _GIB:.2f} GB, percent = {100 * used / total:.1f}%")
    acc.reset_peak_memory_stats()


def prefix_sum_inc(weights: Sequence[float]) -> list[float]:
    """Inclusive prefix sums: [3, 4, 5] -> [3, 7, 12]."""
    return list(itertools.accumulate(weights))


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Bounds of `num_parts` contiguous runs of `num_items` items, as equal as they can be
    (the first runs take one extra); with no more items than runs, one item per run until
    they run out. Part p is items[bounds[p]:bounds[p + 1]]."""
    if num_parts < 1 or num_items < 0:
        raise ValueError(f"partition_uniform({num_items}, {num_parts}): at least one part and no "
                         "negative number of items")
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Bounds of `num_parts` contiguous runs of `weights` whose heaviest run is as light as
    it can be: meshspeed's pipeline cut (meshspeed/parallel/pipeline/partition.py, Note
    [balanced contiguous cuts]; DeepSpeed minimises the heaviest minus the lightest run,
    which picks the same cut where the test cases of both agree). With no more weights than
    parts, `partition_uniform`."""
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    return balanced_cuts(list(weights), num_parts)


class PartitionedTensor:
    """A tensor split over the ranks of `group`: each keeps one contiguous run of its
    flattened elements (`partition_uniform` of the element count); `full()` gathers it back.

    `to_meta()` describes the split as one integer tensor (the shape, the number of parts,
    this rank and the bounds), which with a rank's own part rebuilds the object elsewhere:
    `PartitionedTensor.from_meta(meta, local_part, group)`."""

    def __init__(self, tensor: torch.Tensor, group: Any, partition_meta: torch.Tensor | None = None):
        self.group = group
        self.num_parts = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.orig_device = tensor.device
        if partition_meta is not None:  # `tensor` is this rank's part already (from_meta)
            self.orig_size, parts, rank, self.partition = _read_meta(partition_meta)
            if (parts, rank) != (self.num_parts, self.rank):
                raise ValueError(f"PartitionedTensor meta is for rank {rank} of {parts}, but this is rank "
                                 f"{self.rank} of {self.num_parts} in the group")
            self.local_data = tensor.detach()
        else:
            self.orig_size = list(tensor.size())
            self.partition = partition_uniform(tensor.numel(), self.num_parts)
            lo, hi = self.partition[self.rank], self.partition[self.rank + 1]
            self.local_data = tensor.detach().reshape(-1)[lo:hi].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: Any = None) -> PartitionedTensor:
        return cls(local_part if device is None else local_part.to(device), group, partition_meta=meta)

    def to_meta(self) -> torch.Tensor:
        return torch.tensor([len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition],
                            dtype=torch.long)

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's part (collective over the group)."""
        width = max(b - a for a, b in zip(self.partition, self.partition[1:]))
        mine = torch.zeros(width, dtype=self.local_data.dtype, device=self.local_data.device)
        mine[: self.local_data.numel()] = self.local_data
        pieces = [torch.empty_like(mine) for _ in range(self.num_parts)]
        comm.all_gather(pieces, mine, group=self.group)
        flat = torch.cat([p[: b - a] for p, a, b in zip(pieces, self.partition, self.partition[1:])])
        out = flat.view(self.orig_size)
        return out if device is None else out.to(device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size


def _read_meta(meta: torch.Tensor) -> tuple[list[int], int, int, list[int]]:
    values = [int(v) for v in meta.tolist()]
    ndim = values[0]
    size, (parts, rank), bounds = values[1 : 1 + ndim], values[1 + ndim : 3 + ndim], values[3 + ndim :]
    if len(bounds) != parts + 1:
        raise ValueError(f"PartitionedTensor meta {values} does not describe {parts} parts")
    return size, parts, rank, bounds


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """How a call of `base` with these arguments reads: `call_to_str("f", 1, k="v")` is
    `"f(1, k='v')"` (arguments as repr, keywords after positionals)."""
    parts = [repr(a) for a in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(parts)})"

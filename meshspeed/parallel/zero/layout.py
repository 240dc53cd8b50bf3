"""How one parameter, and one unit of parameters, is split across data-parallel ranks.

Pure index math, no tensors and no processes.

Note [per-parameter sharding]
Each parameter is flattened and padded to a multiple of the group size N, then cut into N
equal contiguous chunks: rank r owns elements [r*c, (r+1)*c) of the padded flat parameter,
c = ceil(numel / N). A *unit* (the parameters moved by one collective) concatenates its
parameters' chunks, so a rank's shard of a unit is one contiguous buffer:

    shard(rank r) = [ p0[r*c0:(r+1)*c0] | p1[r*c1:(r+1)*c1] | ... ]        (unit.shard_numel)

An all-gather of that buffer yields an (N, shard_numel) matrix whose column block
[off_i, off_i + c_i) is parameter i padded and viewed as (N, c_i); a reduce-scatter takes
the same matrix as input. The copy into and out of that matrix is the price of every rank
owning a slice of every parameter (rather than whole parameters per rank), which keeps
the work balanced and the padding at most N-1 elements per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's split across `world` ranks, and its place in its unit's shard."""

    name: str
    shape: tuple[int, ...]
    world: int
    offset: int  # start of this parameter's chunk inside the unit shard buffer

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def chunk(self) -> int:
        return -(-self.numel // self.world)  # ceil division; chunk >= 1 for numel >= 1

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def valid(self, rank: int) -> int:
        """How many of rank's chunk elements are real (the rest is padding)."""
        return max(0, min(self.chunk, self.numel - rank * self.chunk))


@dataclass(frozen=True)
class UnitLayout:
    """The shard layout of a group of parameters communicated together."""

    params: tuple[ParamLayout, ...]
    world: int

    @classmethod
    def build(cls, named_shapes: list[tuple[str, tuple[int, ...]]], world: int) -> UnitLayout:
        layouts, offset = [], 0
        for name, shape in named_shapes:
            layout = ParamLayout(name, tuple(shape), world, offset)
            layouts.append(layout)
            offset += layout.chunk
        return cls(tuple(layouts), world)

    @property
    def shard_numel(self) -> int:
        return sum(p.chunk for p in self.params)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

"""DeepSpeed's `ProcessTopology`: named axes over ranks, row-major. Pure integers.

``ProcessTopology(axes=["pipe", "data"], dims=[2, 4])`` lays 8 ranks out as a 2 x 4 grid
whose last axis varies fastest: rank = pipe * 4 + data. Scripts written for DeepSpeed's
pipeline engine build these (`PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`) and
hand them to `PipelineModule(topology=...)`; meshspeed's own layout is
`meshspeed.topology.ParallelDims`.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Sequence
from itertools import product

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]


class ProcessTopology:
    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"axes {list(axes)} and dims {list(dims)}: one distinct name per dimension")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"dims must be positive integers, got {list(dims)}")
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        # stride of each axis in the linear rank: the product of the dims after it
        self._strides = [math.prod(self.dims[i + 1:]) for i in range(len(self.dims))]

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """Length of `axis`; 0 for an axis this topology does not have."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        """The rank at a full coordinate: ``topo.get_rank(pipe=1, data=0)``."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank() needs a coordinate on every axis {self.axes}, got "
                             f"{sorted(coord)}; select partial coordinates with filter_match()")
        for axis, value in coord.items():
            if not 0 <= value < self.get_dim(axis):
                raise ValueError(f"{axis}={value} is outside [0, {self.get_dim(axis)})")
        return sum(coord[a] * s for a, s in zip(self.axes, self._strides))

    def get_coord(self, rank: int):
        """The coordinate of `rank`, as a namedtuple with one field per axis."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} is outside this topology of {self.world_size()} ranks")
        return self.ProcessCoord(*((rank // s) % d for s, d in zip(self._strides, self.dims)))

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``"model_01"``-style name of `rank`'s coordinate on the axes not omitted."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes
                              if a not in set(omit_axes))

    def filter_match(self, **coord: int) -> list[int]:
        """Ranks (ascending) whose coordinate matches every given axis value."""
        return [r for r in range(self.world_size())
                if all(getattr(self.get_coord(r), a) == v for a, v in coord.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on `axis` is `idx`."""
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The process groups along `axis`: one list per coordinate of the other axes,
        holding the ranks that differ only on `axis`; [] if there is no such axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        groups = []
        for values in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            groups.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return groups

    def __str__(self) -> str:
        return ", ".join(f"{a}={d}" for a, d in zip(self.axes, self.dims))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallel; data parallel is the fast axis (gradient reductions stay
    between neighbouring ranks, pipeline traffic crosses nodes)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallel, model parallel fastest."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])

"""DeepSpeed's `ProcessTopology`: named axes over ranks, row-major. Pure integers.

``ProcessTopology(axes=["pipe", "data"], dims=[2, 4])`` lays 8 ranks out as a 2 x 4 grid
whose last axis varies fastest: rank = pipe * 4 + data. Scripts written for DeepSpeed's
pipeline engine build these (`PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`) and
hand them to `PipelineModule(topology=...)`; meshspeed's own layout is
`meshspeed.topology.ParallelDims`. `PipelineParallelGrid` makes a topology's process groups
(the mpu object DeepSpeed's pipeline engine builds, and scripts pass as `mpu=`).
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Sequence
from itertools import product
from typing import Any

import torch.distributed as dist

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "ProcessTopology"]


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


def _prime_factors(n: int) -> list[int]:
    """The prime factors of `n`, smallest first, with repeats: 12 -> [2, 2, 3]; [] for 1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"_prime_factors({n!r}): a positive integer")
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _default_topology(world: int) -> PipeDataParallelTopology:
    """DeepSpeed's layout when the grid is given none: the world's prime factors dealt in
    turn to the pipe and data axes (12 ranks: pipe 2 x 3 = 6, data 2)."""
    pipe = data = 1
    for i, p in enumerate(_prime_factors(world)):
        if i % 2 == 0:
            pipe *= p
        else:
            data *= p
    return PipeDataParallelTopology(num_pp=pipe, num_dp=data)


def _groups(layout: list[list[int]], rank: int) -> tuple[list[int], Any]:
    """Make a process group for every list of `layout` (collective: every rank makes every
    group, in order) and return this rank's list and group."""
    mine: tuple[list[int], Any] = ([], None)
    for ranks in layout:
        group = dist.new_group(ranks=list(ranks))
        if rank in ranks:
            mine = (list(ranks), group)
    return mine


class PipelineParallelGrid:
    """This rank's place in a pipe x data (x model) `ProcessTopology`, and the process
    groups along each axis: DeepSpeed's mpu for pipelines. Collective: every rank builds
    the grid (it makes process groups). Without a topology, the world's prime factors are
    dealt to the pipe and data axes in turn."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None):
        if not dist.is_initialized():
            raise RuntimeError("PipelineParallelGrid needs the process group: call "
                               "deepspeed.init_distributed() (or launch with the launcher) first")
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._topo = topology if topology is not None else _default_topology(self.world_size)
        missing = [a for a in ("pipe", "data") if a not in self._topo.get_axis_names()]
        if missing:
            raise ValueError(f"PipelineParallelGrid topology {self._topo!r} has no {' or '.join(missing)} "
                             "axis; use PipeDataParallelTopology or PipeModelDataParallelTopology")
        if not self._is_grid_valid():
            raise ValueError(f"PipelineParallelGrid topology {self._topo} covers {self._topo.world_size()} "
                             f"ranks, the job has {self.world_size}")
        topo = self._topo
        self.data_parallel_size = max(topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        rank = self.global_rank
        # every rank of one pipeline (all stages and model slices of a data index)
        model_layout = [topo.get_axis_list("data", d) for d in range(self.data_parallel_size)]
        ranks, self.ds_model_proc_group = _groups(model_layout, rank)
        self.ds_model_world_size, self.ds_model_rank = len(ranks), ranks.index(rank)
        self.dp_groups = topo.get_axis_comm_lists("data")
        self.dp_group, self.dp_proc_group = _groups(self.dp_groups, rank)
        self.p2p_groups = self._build_p2p_groups()
        self.pipe_groups = topo.get_axis_comm_lists("pipe")
        self.pp_group, self.pp_proc_group = _groups(self.pipe_groups, rank)
        if self.model_parallel_size == 1:  # each rank its own slice group
            self.slice_group, self.slice_proc_group = _groups([[r] for r in range(self.world_size)], rank)
        else:
            self.model_groups = topo.get_axis_comm_lists("model")
            self.slice_group, self.slice_proc_group = _groups(self.model_groups, rank)

    def get_stage_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).pipe

    def get_data_parallel_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).data

    def _build_p2p_groups(self) -> list[list[int]]:
        """For every rank, [rank, the rank of the next stage of its pipeline] (the last
        stage's next is the first)."""
        out = []
        for rank in range(self.world_size):
            line = next(g for g in self._topo.get_axis_comm_lists("pipe") if rank in g)
            out.append([rank, line[(line.index(rank) + 1) % len(line)]])
        return out

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == dist.get_world_size()

    def stage_to_global(self, stage_id: int, **coord: int) -> int:
        """The global rank of stage `stage_id` with this rank's other coordinates (or those
        given: ``stage_to_global(1, data=0)``)."""
        unknown = set(coord) - set(self._topo.get_axis_names())
        if unknown:
            raise ValueError(f"stage_to_global: {sorted(unknown)} not axes of {self._topo.get_axis_names()}")
        me = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **coord)
        return self._topo.get_rank(**me._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    # pipeline
    def get_pipe_parallel_rank(self) -> int:
        return self.get_stage_id()

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    get_pipeline_model_parallel_group = get_pipe_parallel_group

    # data
    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    # the whole pipeline a rank belongs to (pipe x model), DeepSpeed's "model parallel"
    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    # tensor slicing (the "model" axis)
    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    get_tensor_model_parallel_rank = get_slice_parallel_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    # the group getters under Megatron's names too, beside DeepSpeed's rank and size ones
    get_tensor_model_parallel_group = get_slice_parallel_group


"""`deepspeed.runtime.pipe.topology.PipelineParallelGrid` (meshspeed/compat/deepspeed/runtime/
pipe/topology.py): a rank's stage and data index on a pipe x data topology, and process
groups along each axis that reduce over exactly the ranks the topology says."""

import pytest
import torch

from meshspeed.compat.deepspeed.runtime.pipe.topology import (
    PipelineParallelGrid,
    ProcessTopology,
    _default_topology,
    _prime_factors,
)
from meshspeed.testing import run_distributed


def _grid_2x2():
    torch.set_num_threads(1)
    grid = PipelineParallelGrid(topology=ProcessTopology(axes=["pipe", "data"], dims=[2, 2]))
    rank = torch.distributed.get_rank()

    def summed(group):
        t = torch.tensor([rank])
        torch.distributed.all_reduce(t, group=group)
        return int(t)

    return {
        "stage": grid.get_stage_id(), "data": grid.get_data_parallel_rank(),
        "first": grid.is_first_stage, "last": grid.is_last_stage,
        "pp": grid.pp_group, "dp": grid.dp_group, "slice": grid.slice_group,
        "pp_sum": summed(grid.get_pipe_parallel_group()), "dp_sum": summed(grid.get_data_parallel_group()),
        "model_sum": summed(grid.get_model_parallel_group()),
        "sizes": (grid.get_pipe_parallel_world_size(), grid.get_data_parallel_world_size(),
                  grid.get_model_parallel_world_size(), grid.get_slice_parallel_world_size()),
        "to_stage": [grid.stage_to_global(0), grid.stage_to_global(1), grid.stage_to_global(1, data=0)],
        "p2p": grid.p2p_groups,
    }


def test_grid_on_a_2x2_topology():
    out = run_distributed(_grid_2x2, world_size=4)
    # rank = pipe * 2 + data
    assert [(o["stage"], o["data"]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(o["first"], o["last"]) for o in out] == [(True, False)] * 2 + [(False, True)] * 2
    assert [o["pp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["dp"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["slice"] for o in out] == [[0], [1], [2], [3]]
    assert [o["pp_sum"] for o in out] == [2, 4, 2, 4]
    assert [o["dp_sum"] for o in out] == [1, 1, 5, 5]
    assert [o["model_sum"] for o in out] == [2, 4, 2, 4]  # a whole pipeline: its stages
    assert all(o["sizes"] == (2, 2, 2, 1) for o in out)
    assert [o["to_stage"] for o in out] == [[0, 2, 2], [1, 3, 2], [0, 2, 2], [1, 3, 2]]
    assert out[0]["p2p"] == [[0, 2], [1, 3], [2, 0], [3, 1]]


def _grid_of(axes, dims):
    torch.set_num_threads(1)
    try:
        PipelineParallelGrid(topology=ProcessTopology(axes, dims))
    except ValueError as err:
        return str(err)
    return None


def test_grid_refuses_a_topology_of_another_size_or_without_a_pipe_axis():
    out = run_distributed(_grid_of, world_size=2, args=(["pipe", "data", "model"], [2, 1, 2]))
    assert all("covers 4 ranks, the job has 2" in o for o in out)
    out = run_distributed(_grid_of, world_size=2, args=(["row", "data"], [1, 2]))
    assert all("no pipe axis" in o for o in out)


def test_prime_factors_and_the_default_layout():
    assert _prime_factors(1) == [] and _prime_factors(12) == [2, 2, 3] and _prime_factors(29) == [29]
    with pytest.raises(ValueError, match="positive integer"):
        _prime_factors(0)
    assert _default_topology(12).dims == [6, 2] and _default_topology(8).dims == [4, 2]
    assert _default_topology(1).dims == [1, 1]

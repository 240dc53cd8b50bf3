"""ParallelDims: rank arithmetic, group lists and validation. No processes."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshspeed.topology.degrees import AXES, ParallelDims


def singletons(n: int) -> list[list[int]]:
    return [[r] for r in range(n)]


def test_16_ranks_tp2_pp4_dp2():
    dims = ParallelDims(16, tp=2, pp=4)
    assert (dims.dp, dims.cp, dims.ep, dims.edp) == (2, 1, 1, 2)
    assert dims.mesh_shape == (4, 2, 1, 2)
    assert dims.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7],
                                 [8, 9], [10, 11], [12, 13], [14, 15]]
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7],
                                 [8, 10], [9, 11], [12, 14], [13, 15]]
    assert dims.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert dims.groups("cp") == singletons(16)
    assert dims.groups("dp_cp") == dims.groups("dp")
    assert dims.groups("ep") == singletons(16)
    assert dims.groups("edp") == dims.groups("dp")
    assert dims.coords(13) == {"pp": 3, "dp": 0, "cp": 0, "tp": 1, "dp_cp": 0, "ep": 0, "edp": 0}
    assert dims.rank_of(pp=2, dp=1, tp=1) == 11
    assert dims.group_of("pp", 6) == [2, 6, 10, 14]


def test_8_ranks_tp2_cp2_dp2():
    dims = ParallelDims(8, tp=2, cp=2)
    assert dims.dp == 2
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.groups("pp") == singletons(8)
    assert dims.coords(6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0, "dp_cp": 3, "ep": 0, "edp": 1}


def test_expert_groups_dp4_ep2():
    dims = ParallelDims(4, ep=2)
    assert dims.groups("ep") == [[0, 1], [2, 3]]  # consecutive blocks of the dp group
    assert dims.groups("edp") == [[0, 2], [1, 3]]  # same expert shard
    assert dims.edp == 2

    dims = ParallelDims(8, tp=2, ep=2)  # dp groups [0,2,4,6] and [1,3,5,7]
    assert dims.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(4)["ep"] == 0 and dims.coords(4)["edp"] == 1

    dims = ParallelDims(4, ep=4)  # all experts spread over the whole dp group
    assert dims.groups("ep") == [[0, 1, 2, 3]]
    assert dims.groups("edp") == singletons(4)


def test_sp_is_an_alias_for_cp():
    assert ParallelDims(8, sp=2) == ParallelDims(8, cp=2)
    assert ParallelDims.with_sp(8, sp=4, tp=2).cp == 4
    assert ParallelDims(8, cp=2, sp=2).cp == 2
    with pytest.raises(ValueError, match="sp 2 and cp 4"):
        ParallelDims(8, cp=4, sp=2)
    dims = dataclasses.replace(ParallelDims(8, sp=2), cp=4)  # replace keeps working
    assert dims.cp == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "tp": 4}, "world_size 6 is not divisible by tp 4 x pp 1 x cp 1 = 4; launch a multiple of 4 processes (now 6)"),
        ({"world_size": 8, "tp": 2, "pp": 2, "cp": 4},
         "world_size 8 is not divisible by tp 2 x pp 2 x cp 4 = 16"),
        ({"world_size": 4, "tp": 2, "ep": 4}, 
         "ep 4 must divide dp 2 (world_size / (tp x pp x cp)); use an ep that divides 2, or launch a multiple of 8 processes (now 4)"),
        ({"world_size": 12, "ep": 5}, "ep 5 must divide dp 12"),
        ({"world_size": 0}, "world_size must be a positive integer, got 0"),
        ({"world_size": 4, "tp": -2}, "tp must be a positive integer, got -2"),
        ({"world_size": 4, "pp": 1.0}, "pp must be a positive integer, got 1.0"),
    ],
)
def test_invalid_degrees_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims(**kwargs)


def test_bad_rank_axis_and_coordinates():
    dims = ParallelDims(4, tp=2)
    with pytest.raises(ValueError, match="rank 4 out of range"):
        dims.coords(4)
    with pytest.raises(ValueError, match="unknown axis 'mp'"):
        dims.groups("mp")
    with pytest.raises(ValueError, match="tp coordinate 2 out of range"):
        dims.rank_of(tp=2)


def test_str_is_one_readable_line():
    assert str(ParallelDims(16, tp=2, pp=4)) == "16 ranks = pp 4 x dp 2 x cp 1 x tp 2"
    text = str(ParallelDims(8, ep=4))
    assert "\n" not in text and "ep 4 x edp 2" in text


def test_keyword_only_degrees():
    with pytest.raises(TypeError):
        ParallelDims(8, 2)  # ParallelDims(8, 2) would be ambiguous: tp? pp?


@st.composite
def parallel_dims(draw):
    tp, pp, cp = (draw(st.integers(1, 4)) for _ in range(3))
    dp = draw(st.integers(1, 6))
    ep = draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0]))
    return ParallelDims(tp * pp * cp * dp, tp=tp, pp=pp, cp=cp, ep=ep)


@settings(max_examples=60, deadline=None)
@given(parallel_dims())
def test_coordinates_round_trip_and_axes_partition(dims):
    all_coords = [dims.coords(rank) for rank in range(dims.world_size)]
    mesh_coords = {(c["pp"], c["dp"], c["cp"], c["tp"]) for c in all_coords}
    assert len(mesh_coords) == dims.world_size  # the mesh is a bijection
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert dims.rank_of(pp=c["pp"], dp=c["dp"], cp=c["cp"], tp=c["tp"]) == rank
    assert dims.ep * dims.edp == dims.dp
    for axis in AXES:
        groups = dims.groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(dims.world_size)), axis  # each rank in exactly one group
        assert all(g == sorted(g) and len(g) == dims.size(axis) for g in groups), axis
        for rank in range(dims.world_size):
            group = dims.group_of(axis, rank)
            assert group in groups
            assert group.index(rank) == dims.coords(rank)[axis], (axis, rank)

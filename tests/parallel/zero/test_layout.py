"""Shard layouts: ParamLayout / UnitLayout index math (Note [per-parameter sharding], used by
zero.Init), checked against a brute-force model, and FlatLayout (Note [flat units])."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshspeed.parallel.zero.flat import FlatLayout
from meshspeed.parallel.zero.layout import ParamLayout, UnitLayout

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
worlds = st.integers(1, 8)
named_shapes = st.lists(shapes, min_size=1, max_size=5).map(
    lambda ss: [(f"p{i}", s) for i, s in enumerate(ss)])


def owned_real_elements(numel: int, world: int, rank: int) -> int:
    """Brute force: rank r owns indices [r*c, (r+1)*c) of the padded flat tensor, c the
    smallest chunk with c*world >= numel; count the indices that are real elements."""
    c = next(c for c in range(numel + 1) if c * world >= numel)
    return sum(1 for i in range(rank * c, (rank + 1) * c) if i < numel)


@settings(deadline=None)
@given(shape=shapes, world=worlds)
def test_param_layout_matches_brute_force(shape, world):
    lay = ParamLayout("w", shape, world, offset=0)
    numel = math.prod(shape)
    assert lay.numel == numel
    assert lay.chunk == math.ceil(numel / world)
    assert lay.chunk * world >= numel > (lay.chunk - 1) * world  # the smallest such chunk
    assert lay.padded_numel == lay.chunk * world
    assert lay.padding == lay.padded_numel - numel
    assert 0 <= lay.padding < world  # at most N-1 padding elements per parameter
    valid = [lay.valid(r) for r in range(world)]
    assert valid == [owned_real_elements(numel, world, r) for r in range(world)]
    assert sum(valid) == numel
    assert all(0 <= v <= lay.chunk for v in valid)
    # full chunks first, then at most one partial chunk, then empty ones
    assert valid == sorted(valid, reverse=True)
    assert sum(0 < v < lay.chunk for v in valid) <= 1
    assert lay.valid(world) == 0  # past the last rank: nothing


@settings(deadline=None)
@given(named=named_shapes, world=worlds)
def test_unit_layout_offsets_concatenate_chunks(named, world):
    unit = UnitLayout.build(named, world)
    assert unit.world == world
    assert [p.name for p in unit.params] == [n for n, _ in named]
    assert [p.shape for p in unit.params] == [s for _, s in named]
    assert all(p.world == world for p in unit.params)
    offset = 0
    for p in unit.params:
        assert p.offset == offset
        offset += p.chunk
    assert unit.shard_numel == offset == unit.params[-1].offset + unit.params[-1].chunk
    assert unit.numel == sum(math.prod(s) for _, s in named)
    assert unit.padded_numel == unit.shard_numel * world == sum(p.padded_numel for p in unit.params)
    # every rank's valid elements over all parameters add up to the unit's elements
    assert sum(p.valid(r) for p in unit.params for r in range(world)) == unit.numel


@settings(deadline=None, max_examples=50)
@given(named=named_shapes, world=worlds)
def test_shards_all_gathered_rebuild_every_parameter(named, world):
    """Rank r's shard is [p0[r*c0:(r+1)*c0] | p1[...] | ...]; stacking the N shards gives an
    (N, shard_numel) matrix whose column block [off, off+c) is parameter i padded."""
    unit = UnitLayout.build(named, world)
    full = [torch.arange(p.numel, dtype=torch.float32) + 1000 * i for i, p in enumerate(unit.params)]
    padded = [torch.cat([f, torch.full((p.padding,), -1.0)]) for f, p in zip(full, unit.params)]
    shards = [torch.cat([pad[r * p.chunk:(r + 1) * p.chunk] for pad, p in zip(padded, unit.params)])
              for r in range(world)]
    assert all(s.numel() == unit.shard_numel for s in shards)
    for r, s in enumerate(shards):  # each shard holds exactly valid(r) real elements per param
        for p in unit.params:
            piece = s[p.offset:p.offset + p.chunk]
            assert int((piece >= 0).sum()) == p.valid(r)
    matrix = torch.stack(shards)
    assert matrix.shape == (world, unit.shard_numel)
    for f, p in zip(full, unit.params):
        block = matrix[:, p.offset:p.offset + p.chunk]
        assert torch.equal(block.reshape(-1)[:p.numel], f)
        assert torch.all(block.reshape(-1)[p.numel:] == -1.0)


@pytest.mark.parametrize("numel, world, chunk, valid", [
    (0, 3, 0, [0, 0, 0]),  # an empty parameter: no chunk, no padding
    (1, 1, 1, [1]),
    (1, 4, 1, [1, 0, 0, 0]),  # numel == 1: one real element, the rest padding
    (3, 8, 1, [1, 1, 1, 0, 0, 0, 0, 0]),  # numel < world: trailing ranks own nothing real
    (8, 8, 1, [1] * 8),
    (9, 8, 2, [2, 2, 2, 2, 1, 0, 0, 0]),  # ceil pushes ranks 5..7 past the end
    (10, 4, 3, [3, 3, 3, 1]),
    (12, 4, 3, [3, 3, 3, 3]),
    (7, 3, 3, [3, 3, 1]),
])
def test_param_layout_edge_cases(numel, world, chunk, valid):
    lay = ParamLayout("w", (numel,), world, offset=5)
    assert lay.chunk == chunk
    assert [lay.valid(r) for r in range(world)] == valid
    assert lay.padding == chunk * world - numel
    assert lay.offset == 5  # the offset is carried, not used by the per-param math


def test_scalar_parameter_has_one_element():
    lay = ParamLayout("scale", (), 3, offset=0)
    assert (lay.numel, lay.chunk, lay.padded_numel, lay.padding) == (1, 1, 3, 2)
    assert [lay.valid(r) for r in range(3)] == [1, 0, 0]


def test_unit_layout_example():
    unit = UnitLayout.build([("w", (4, 5)), ("b", (5,)), ("g", ())], world=3)
    assert [(p.chunk, p.offset) for p in unit.params] == [(7, 0), (2, 7), (1, 9)]
    assert (unit.shard_numel, unit.numel, unit.padded_numel) == (10, 26, 30)
    assert [[p.valid(r) for r in range(3)] for p in unit.params] == [[7, 7, 6], [2, 2, 1], [1, 0, 0]]


def test_empty_unit_layout():
    unit = UnitLayout.build([], world=4)
    assert unit.params == ()
    assert (unit.shard_numel, unit.numel, unit.padded_numel) == (0, 0, 0)


# -- FlatLayout: the flat units of every stage (a contiguous range of the padded flat buffer per rank)


@given(numels=st.lists(st.integers(0, 300), min_size=1, max_size=8), world=st.integers(1, 8))
def test_flat_spans_tile_every_parameter_exactly_once(numels, world):
    layout = FlatLayout(tuple(numels), world)
    assert layout.padded_numel == layout.shard_numel * world >= layout.numel
    assert layout.padded_numel - layout.numel < world or layout.numel == 0
    covered = [[0] * n for n in numels]
    for rank in range(world):
        spans = layout.spans(rank)
        assert len(spans) == len(numels)
        for i, s in enumerate(spans):
            assert 0 <= s.start and s.start + s.numel <= numels[i]
            assert 0 <= s.offset and s.offset + s.numel <= layout.shard_numel
            # the span sits where the parameter's elements are in the flat buffer
            if s.numel:
                assert rank * layout.shard_numel + s.offset == layout.offsets[i] + s.start
            for k in range(s.start, s.start + s.numel):
                covered[i][k] += 1
    assert all(c == 1 for row in covered for c in row)


def test_flat_spans_of_a_small_parameter_on_many_ranks():
    layout = FlatLayout((3, 10), 4)  # 13 elements -> 4 per rank, padded to 16
    assert layout.shard_numel == 4 and layout.offsets == (0, 3)
    assert [(s.start, s.numel, s.offset) for s in layout.spans(0)] == [(0, 3, 0), (0, 1, 3)]
    assert [(s.start, s.numel, s.offset) for s in layout.spans(3)] == [(3, 0, 0), (9, 1, 0)]

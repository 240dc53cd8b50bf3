"""Collectives over a group of one process (Note [a group of one] in meshspeed/comm/local.py):
the backend's values bit for bit, without the backend, still recorded in the sequence."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshspeed import comm
from meshspeed.comm import collectives, sequence
from meshspeed.testing import run_distributed


def _values(dtype):
    g = torch.Generator().manual_seed(comm.get_rank() + 7)
    return torch.randn(24, generator=g).to(dtype)


def _backend_results(group, dtype) -> dict:
    """What gloo itself gives for the calls `_local_results` makes."""
    out = {}
    for op in ("sum", "max", "min", "prod"):
        t = _values(dtype)
        dist.all_reduce(t, op=collectives._NAMED_OPS[op], group=group)
        out[f"all_reduce {op}"] = t
    t = _values(dtype)
    dist.all_reduce(t, group=group)
    out["all_reduce avg"] = t / dist.get_world_size(group)
    g = torch.empty(24, dtype=dtype)
    collectives._all_gather_single(g, _values(dtype), group=group)
    out["all_gather"] = g
    r = torch.empty(24, dtype=dtype)
    collectives._reduce_scatter_single(r, _values(dtype), group=group)
    out["reduce_scatter"] = r
    return out


def _local_results(group, dtype) -> dict:
    out = {}
    for op in ("sum", "max", "min", "prod", "avg"):
        t = _values(dtype)
        assert comm.all_reduce(t, group=group, op=op) is None
        out[f"all_reduce {op}"] = t
    g = torch.empty(24, dtype=dtype)
    work = comm.all_gather_into_tensor(g, _values(dtype), group=group, async_op=True)
    assert work.is_completed() and work.wait()
    out["all_gather"] = g
    r = torch.empty(24, dtype=dtype)
    comm.reduce_scatter_tensor(r, _values(dtype), group=group, async_op=True).wait()
    out["reduce_scatter"] = r
    return out


def _one_body():
    """Every rank alone in its own group (a mesh dimension of size 1), and the whole world
    when it is one process."""
    groups = [dist.new_group([r]) for r in range(comm.get_world_size())]
    group = groups[comm.get_rank()] if comm.get_world_size() > 1 else None
    for dtype in (torch.float32, torch.bfloat16):
        expected = _backend_results(group, dtype)
        before = sequence.peek(group)
        backend = (dist.all_reduce, collectives._all_gather_single, collectives._reduce_scatter_single)

        def refuse(*args, **kwargs):
            raise AssertionError("a group of one called the backend")

        dist.all_reduce = collectives._all_gather_single = collectives._reduce_scatter_single = refuse
        try:
            got = _local_results(group, dtype)
        finally:
            dist.all_reduce, collectives._all_gather_single, collectives._reduce_scatter_single = backend
        assert sequence.peek(group) == before + 7  # still recorded, one per call
        for name, want in expected.items():
            assert torch.equal(got[name], want), (name, dtype)
    # a shard already in its own range of the gathered buffer stays where it is
    flat = _values(torch.float32)
    ptr, values = flat.data_ptr(), flat.clone()
    comm.all_gather_into_tensor(flat, flat[:24], group=group)
    assert flat.data_ptr() == ptr and torch.equal(flat, values)
    with pytest.raises(ValueError, match="output like its input"):
        comm.all_gather_into_tensor(torch.empty(24, dtype=torch.bfloat16), flat, group=group)
    # a group of two still goes to the backend
    if comm.get_world_size() == 2:
        t = torch.ones(3)
        comm.all_reduce(t)
        assert torch.equal(t, torch.full((3,), 2.0))
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_group_of_one_is_the_backend_without_it(world_size):
    assert all(run_distributed(_one_body, world_size))

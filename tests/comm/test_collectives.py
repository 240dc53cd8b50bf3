"""Results of every collective in meshspeed.comm on gloo, at world sizes 2, 3 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from meshspeed import comm
from meshspeed.testing import run_distributed, world_sizes


def _ranked(shape, dtype=torch.float32):
    """A tensor whose values identify the rank: rank r holds r + 1 + arange."""
    rank = comm.get_rank()
    return (
        (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + rank + 1)
        .reshape(shape)
        .to(dtype)
    )


# -- rank bodies --------------------------------------------------------------------------------


def _all_reduce_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    base = torch.arange(6, dtype=torch.float32)
    expected_sum = n * base + n * (n + 1) / 2

    t = _ranked((6,))
    assert comm.all_reduce(t) is None
    assert_close(t, expected_sum)

    t = _ranked((6,))
    comm.all_reduce(t, op="avg")
    assert_close(t, expected_sum / n)

    t = _ranked((6,))
    comm.all_reduce(t, op=dist.ReduceOp.AVG)  # a ReduceOp also gets the gloo fallback
    assert_close(t, expected_sum / n)

    t = _ranked((6,))
    comm.all_reduce(t, op="max")
    assert_close(t, base + n)

    t = _ranked((6,))
    comm.all_reduce(t, op=dist.ReduceOp.MIN)
    assert_close(t, base + 1)

    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t, op="prod")
    assert_close(t, torch.full((3,), float(torch.arange(1, n + 1).prod())))

    t = _ranked((6,), torch.bfloat16)
    comm.all_reduce(t)
    assert t.dtype == torch.bfloat16
    assert_close(t, expected_sum.to(torch.bfloat16))

    t = _ranked((6,), torch.int64)
    comm.all_reduce(t)
    assert torch.equal(t, expected_sum.long())

    t = _ranked((6,))
    work = comm.all_reduce(t, op="avg", async_op=True)
    work.wait()
    assert_close(t, expected_sum / n)
    return True


def _gather_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    mine = torch.full((2, 3), float(rank))
    expected = torch.cat([torch.full((2, 3), float(r)) for r in range(n)])

    out = torch.empty(2 * n, 3)
    comm.all_gather_into_tensor(out, mine)
    assert_close(out, expected)

    out = torch.empty(2 * n, 3)
    comm.all_gather_into_tensor(out, mine, async_op=True).wait()
    assert_close(out, expected)

    parts = [torch.empty(2, 3) for _ in range(n)]
    comm.all_gather(parts, mine)
    assert_close(torch.cat(parts), expected)
    return True


def _reduce_scatter_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    full = torch.arange(2 * n, dtype=torch.float32) + 10 * rank  # rank r adds 10r everywhere
    offset = 10 * n * (n - 1) / 2
    mine = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32)

    out = torch.empty(2)
    comm.reduce_scatter_tensor(out, full)
    assert_close(out, n * mine + offset)

    out = torch.empty(2)
    comm.reduce_scatter_tensor(out, full, op="avg")
    assert_close(out, mine + offset / n)

    out = torch.empty(2)
    comm.reduce_scatter_tensor(out, full, op="avg", async_op=True).wait()
    assert_close(out, mine + offset / n)
    return True


def _all_to_all_even_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    # chunk j of rank r holds 100r + j; after the exchange chunk j holds 100j + r.
    inp = torch.tensor([100.0 * rank + j for j in range(n) for _ in range(2)])
    out = torch.empty_like(inp)
    comm.all_to_all_single(out, inp)
    assert_close(out, torch.tensor([100.0 * j + rank for j in range(n) for _ in range(2)]))
    return True


def _all_to_all_uneven_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    # Rank r sends (j + 1) rows to rank j, so rank r receives (r + 1) rows from each rank.
    in_splits = [j + 1 for j in range(n)]
    out_splits = [rank + 1] * n
    inp = torch.cat([torch.full((j + 1, 2), 100.0 * rank + j) for j in range(n)])
    out = torch.empty(sum(out_splits), 2)
    comm.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    expected = torch.cat([torch.full((rank + 1, 2), 100.0 * j + rank) for j in range(n)])
    assert_close(out, expected)
    return True


def _broadcast_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    src = n - 1
    t = torch.full((4,), float(rank))
    comm.broadcast(t, src=src)
    assert_close(t, torch.full((4,), float(src)))
    t = torch.full((4,), float(rank))
    comm.broadcast(t, src=0, async_op=True).wait()
    assert_close(t, torch.zeros(4))
    return True


def _p2p_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    # Non-blocking ring: everyone sends right and receives from the left.
    got = torch.empty(3)
    works = [comm.isend(torch.full((3,), float(rank)), right), comm.irecv(got, left)]
    for work in works:
        work.wait()
    assert_close(got, torch.full((3,), float(left)))
    # Blocking pairs: even ranks send first, odd ranks receive first.
    if n >= 2 and rank < n - n % 2:
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        buf = torch.empty(2)
        if rank % 2 == 0:
            comm.send(torch.full((2,), float(rank)), peer)
            comm.recv(buf, peer)
        else:
            comm.recv(buf, peer)
            comm.send(torch.full((2,), float(rank)), peer)
        assert_close(buf, torch.full((2,), float(peer)))
    comm.barrier()
    return True


def _subgroup_body():
    rank = comm.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    local = comm.get_rank(group)
    assert local == rank % 2 and comm.get_world_size(group) == 2

    t = torch.tensor([float(rank)])
    comm.all_reduce(t, group=group)
    pair_sum = float(2 * (rank // 2) * 2 + 1)  # 0+1 or 2+3
    assert_close(t, torch.tensor([pair_sum]))

    # src / dst are ranks within the group: group rank 1 is global rank 1 or 3.
    t = torch.tensor([float(rank)])
    comm.broadcast(t, src=1, group=group)
    assert_close(t, torch.tensor([float(rank // 2 * 2 + 1)]))

    buf = torch.empty(1)
    if local == 0:
        comm.send(torch.tensor([float(rank)]), dst=1, group=group)
    else:
        comm.recv(buf, src=0, group=group)
        assert_close(buf, torch.tensor([float(rank - 1)]))

    gathered = comm.all_gather_object({"rank": rank}, group=group)
    assert [g["rank"] for g in gathered] == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert comm.broadcast_object(f"from {rank}", src=1, group=group) == f"from {rank // 2 * 2 + 1}"
    return True


def _objects_and_queries_body():
    return {
        "initialized": comm.is_initialized(),
        "rank": comm.get_rank(),
        "world": comm.get_world_size(),
        "gathered": comm.all_gather_object(("r", comm.get_rank())),
        "broadcast": comm.broadcast_object({"payload": comm.get_rank()}, src=1),
    }


def _avg_of_integers_body():
    comm.all_reduce(torch.ones(2, dtype=torch.int64), op="avg")


# -- tests ----------------------------------------------------------------------------------------


@world_sizes(2, 4)
def test_all_reduce(world_size):
    assert all(run_distributed(_all_reduce_body, world_size))


@world_sizes(2, 3, 4)
def test_all_gather(world_size):
    assert all(run_distributed(_gather_body, world_size))


@world_sizes(2, 4)
def test_reduce_scatter(world_size):
    assert all(run_distributed(_reduce_scatter_body, world_size))


@world_sizes(2, 4)
def test_all_to_all_even(world_size):
    assert all(run_distributed(_all_to_all_even_body, world_size))


def test_all_to_all_uneven_splits():
    assert all(run_distributed(_all_to_all_uneven_body, 3))


@world_sizes(2, 3)
def test_broadcast(world_size):
    assert all(run_distributed(_broadcast_body, world_size))


@world_sizes(2, 3, 4)
def test_point_to_point(world_size):
    assert all(run_distributed(_p2p_body, world_size))


def test_subgroup_uses_group_local_ranks():
    assert all(run_distributed(_subgroup_body, 4))


def test_object_collectives_and_queries():
    results = run_distributed(_objects_and_queries_body, 2)
    for rank, res in enumerate(results):
        assert res["initialized"] and res["rank"] == rank and res["world"] == 2
        assert res["gathered"] == [("r", 0), ("r", 1)]
        assert res["broadcast"] == {"payload": 1}


def test_avg_of_integers_is_rejected():
    from meshspeed.testing import DistributedTestError

    with pytest.raises(DistributedTestError, match="floating-point"):
        run_distributed(_avg_of_integers_body, 2)


def test_unknown_op_is_rejected_before_communicating():
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.all_reduce(torch.ones(1), op="mean")

"""CommCounter: calls and ring bytes per op equal Note [ring bytes] exactly."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from meshspeed import comm
from meshspeed.comm import COMM_OPS, CommCounter, ring_bytes
from meshspeed.testing import run_distributed, world_sizes

# -- the formula, without processes ----------------------------------------------------------------


def test_ring_bytes_known_values():
    assert ring_bytes("all_reduce", 4000, 4) == 6000  # 1000 fp32 at N=4: 2*3/4*4000
    assert ring_bytes("all_reduce", 4000, 2) == 4000
    assert ring_bytes("all_gather", 4000, 4) == 3000
    assert ring_bytes("reduce_scatter", 4000, 4) == 3000
    assert ring_bytes("all_to_all", 4000, 4) == 3000
    assert ring_bytes("broadcast", 4000, 4) == 3000
    assert ring_bytes("send", 4000, 4) == 4000
    assert ring_bytes("recv", 4000, 4) == 4000


def test_ring_bytes_rounds_once_half_up():
    assert ring_bytes("all_reduce", 4000, 3) == 5333  # 16000/3 = 5333.33
    assert ring_bytes("all_gather", 10, 3) == 7  # 20/3 = 6.67
    assert ring_bytes("all_gather", 3, 2) == 2  # 1.5 rounds up
    assert ring_bytes("all_reduce", 4000, 1) == 0  # a group of one moves nothing


def test_ring_bytes_rejects_unknown_ops():
    with pytest.raises(ValueError, match="unknown collective"):
        ring_bytes("gather", 10, 2)


def test_summary_lists_all_ops_with_zeros():
    with CommCounter() as counter:
        pass
    assert counter.summary() == {op: {"calls": 0, "bytes": 0} for op in COMM_OPS}
    assert counter.total_bytes() == 0


# -- rank bodies --------------------------------------------------------------------------------


def _every_op_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    with CommCounter() as counter:
        comm.all_reduce(torch.ones(1000))  # 4000 B, fp32
        comm.all_reduce(torch.ones(1000, dtype=torch.bfloat16), op="avg")  # 2000 B
        comm.all_gather_into_tensor(torch.empty(16 * n), torch.ones(16))  # output 64n B
        comm.all_gather([torch.empty(8) for _ in range(n)], torch.ones(8))  # list 32n B
        comm.reduce_scatter_tensor(
            torch.empty(4, dtype=torch.float64), torch.ones(4 * n, dtype=torch.float64)
        )
        comm.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n))  # input 8n B
        comm.broadcast(torch.ones(100), src=0)  # 400 B
        if rank == 0:
            comm.send(torch.ones(25), dst=1)  # 100 B
        elif rank == 1:
            comm.recv(torch.empty(25), src=0)
    return counter.summary(), counter.total_bytes()


def _nested_body():
    with CommCounter() as outer:
        comm.all_reduce(torch.ones(1000))
        with CommCounter() as inner:
            comm.all_reduce(torch.ones(1000))
            comm.broadcast(torch.ones(10), src=0)
        comm.all_gather_into_tensor(torch.empty(2 * comm.get_world_size()), torch.ones(2))
    comm.all_reduce(torch.ones(1000))  # after both exited: nobody counts it
    return outer.summary(), inner.summary()


def _subgroup_body():
    rank = comm.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    with CommCounter() as counter:
        comm.all_reduce(torch.ones(1000), group=group)  # N = 2, not 4
        comm.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=group)
        comm.all_reduce(torch.ones(1000))  # the default group: N = 4
    return counter.summary()


def _uneven_all_to_all_body():
    n, rank = comm.get_world_size(), comm.get_rank()
    in_splits = [j + 1 for j in range(n)]  # rows of 3 fp32 (12 B) to each rank
    inp = torch.ones(sum(in_splits), 3)
    out = torch.empty((rank + 1) * n, 3)
    with CommCounter() as counter:
        comm.all_to_all_single(
            out, inp, output_split_sizes=[rank + 1] * n, input_split_sizes=in_splits
        )
    return counter.summary()["all_to_all"]


def _async_and_reset_body():
    with CommCounter() as counter:
        work = comm.all_reduce(torch.ones(1000), async_op=True)
        counted_at_launch = counter.summary()["all_reduce"]["calls"]
        work.wait()
        peer = 1 - comm.get_rank()
        works = [comm.isend(torch.ones(10), peer), comm.irecv(torch.empty(10), peer)]
        for w in works:
            w.wait()
        before_reset = counter.summary()
        counter.reset()
        comm.broadcast(torch.ones(10), src=0)
    return counted_at_launch, before_reset, counter.summary()


def _threaded_body():
    with CommCounter() as counter:
        thread = threading.Thread(target=comm.all_reduce, args=(torch.ones(1000),))
        thread.start()
        thread.join()
    return counter.summary()["all_reduce"]


# -- tests ----------------------------------------------------------------------------------------


@world_sizes(2, 4)
def test_every_op_is_counted_exactly(world_size):
    n = world_size
    for rank, (summary, total) in enumerate(run_distributed(_every_op_body, n)):
        expected = {
            "all_reduce": {"calls": 2, "bytes": 2 * (n - 1) * 4000 // n + 2 * (n - 1) * 2000 // n},
            "all_gather": {"calls": 2, "bytes": (n - 1) * 64 + (n - 1) * 32},
            "reduce_scatter": {"calls": 1, "bytes": (n - 1) * 32},
            "all_to_all": {"calls": 1, "bytes": (n - 1) * 8},
            "broadcast": {"calls": 1, "bytes": (n - 1) * 400 // n},
            "send": {"calls": int(rank == 0), "bytes": 100 * int(rank == 0)},
            "recv": {"calls": int(rank == 1), "bytes": 100 * int(rank == 1)},
        }
        assert summary == expected
        assert total == sum(v["bytes"] for v in expected.values())


def test_all_reduce_of_1000_fp32_at_4_ranks_moves_6000_bytes():
    for summary, _ in run_distributed(_every_op_body, 4):
        assert summary["all_reduce"]["bytes"] == 6000 + 3000  # fp32 6000 + bf16 3000


def test_counters_nest():
    for outer, inner in run_distributed(_nested_body, 2):
        assert outer["all_reduce"] == {"calls": 2, "bytes": 8000}
        assert outer["broadcast"] == {"calls": 1, "bytes": 20}
        assert outer["all_gather"] == {"calls": 1, "bytes": 8}
        assert inner["all_reduce"] == {"calls": 1, "bytes": 4000}
        assert inner["broadcast"] == {"calls": 1, "bytes": 20}
        assert inner["all_gather"] == {"calls": 0, "bytes": 0}


def test_counter_uses_the_size_of_the_group_passed():
    for summary in run_distributed(_subgroup_body, 4):
        assert summary["all_reduce"] == {"calls": 2, "bytes": 4000 + 6000}
        assert summary["all_gather"] == {"calls": 1, "bytes": 16}


def test_uneven_all_to_all_counts_bytes_leaving_the_rank():
    for rank, stats in enumerate(run_distributed(_uneven_all_to_all_body, 3)):
        total_rows = 1 + 2 + 3
        assert stats == {"calls": 1, "bytes": (total_rows - (rank + 1)) * 12}


def test_async_ops_count_at_launch_and_reset_clears():
    for launched, before, after in run_distributed(_async_and_reset_body, 2):
        assert launched == 1
        assert before["all_reduce"] == {"calls": 1, "bytes": 4000}
        assert before["send"] == {"calls": 1, "bytes": 40}
        assert before["recv"] == {"calls": 1, "bytes": 40}
        assert after["all_reduce"] == {"calls": 0, "bytes": 0}
        assert after["broadcast"] == {"calls": 1, "bytes": 20}


def test_collectives_from_other_threads_are_counted():
    assert run_distributed(_threaded_body, 2) == [{"calls": 1, "bytes": 4000}] * 2

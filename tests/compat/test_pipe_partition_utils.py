"""`deepspeed.runtime.utils` partition helpers (meshspeed/compat/deepspeed/runtime/utils.py):
uniform and balanced bounds, inclusive prefix sums, and a tensor split over ranks that
gathers back whole, also from its meta description."""

import torch

from meshspeed.compat.deepspeed.runtime.utils import (
    PartitionedTensor,
    partition_balanced,
    partition_uniform,
    prefix_sum_inc,
)
from meshspeed.testing import run_distributed


def test_bounds_by_hand():
    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([0.0, 1.1, 30, 3.0], 3) == [0, 2, 3, 4]
    assert partition_balanced([1, 2, 1], 4) == [0, 1, 2, 3, 3]


def _split_worker():
    torch.set_num_threads(1)
    full = torch.arange(15, dtype=torch.float32).view(5, 3)  # 15 elements over 2 ranks: 8 + 7
    part = PartitionedTensor(full, group=None)
    again = PartitionedTensor.from_meta(part.to_meta(), part.data(), None)
    return list(part.local_size()), part.data().tolist(), torch.equal(part.full(), full), torch.equal(again.full(), full)


def test_partitioned_tensor_uneven_over_two_ranks():
    (size0, data0, ok0, meta0), (size1, data1, ok1, meta1) = run_distributed(_split_worker, world_size=2)
    assert (size0, size1) == ([8], [7]) and data0 == list(range(8)) and data1 == list(range(8, 15))
    assert ok0 and ok1 and meta0 and meta1

"""Test support: a multi-rank gloo harness with persistent, reused worker processes.

    from meshspeed.testing import run_distributed
    results = run_distributed(_body, world_size=2)   # results[r] = _body() on rank r

See `harness.py` for what each rank can rely on.
"""

from meshspeed.testing.errors import DistributedTestError, DistributedTimeoutError, RankFailure
from meshspeed.testing.harness import close_pools, pool_pids, run_distributed, world_sizes

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "RankFailure",
    "close_pools",
    "pool_pids",
    "run_distributed",
    "world_sizes",
]

"""ZeRO stages as a table of what is sharded (arXiv:1910.02054, Section 5).

Every stage from 1 on shards the fp32 master weights and the optimizer state (P_os: each
rank steps only its own range); the table says what else is sharded. Stage 0 is plain
data parallelism and lives in `meshspeed.parallel.data`; it is listed so that the whole
progression reads in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    # P_g: gradients are reduce-scattered every micro-step (freed as backward produces
    # them) and only the owned range is kept; otherwise full gradients accumulate over the
    # micro-steps of a step and are reduce-scattered once, at the boundary
    shard_grads: bool
    shard_params: bool  # P_p: parameters live as shards, gathered around each use


STAGES: dict[int, StageSpec] = {
    0: StageSpec(shard_grads=False, shard_params=False),
    1: StageSpec(shard_grads=False, shard_params=False),
    2: StageSpec(shard_grads=True, shard_params=False),
    3: StageSpec(shard_grads=True, shard_params=True),
}

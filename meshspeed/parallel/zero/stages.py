"""ZeRO stages as a table of what is sharded (arXiv:1910.02054, Section 5).

Stage 0 is plain data parallelism and lives in `meshspeed.parallel.data`; it is listed here
so that the whole progression reads in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    shard_optimizer: bool  # P_os: fp32 master weights and optimizer moments, 1/N per rank
    shard_grads: bool  # P_g: reduce-scatter every micro-step, keep only the owned slice
    shard_params: bool  # P_p: parameters live as slices, gathered around each use

    @property
    def reduce_every_micro_step(self) -> bool:
        return self.shard_grads


STAGES: dict[int, StageSpec] = {
    0: StageSpec(shard_optimizer=False, shard_grads=False, shard_params=False),
    1: StageSpec(shard_optimizer=True, shard_grads=False, shard_params=False),
    2: StageSpec(shard_optimizer=True, shard_grads=True, shard_params=False),
    3: StageSpec(shard_optimizer=True, shard_grads=True, shard_params=True),
}

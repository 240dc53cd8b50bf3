"""ZeRO-Offload and ZeRO-Infinity: optimizer state, masters and gradients in host memory,
optimizer state in swap files on NVMe.

  placement.py  OffloadPlacement: which of a ZeRO unit's tensors live on the host
  optimizer.py  OffloadOptimizer: the step on the host, sub-group by sub-group
  state.py      where the state lives between steps (host memory or swap files)
  masters.py    fp32 masters in swap files with device "nvme" (Note [masters on NVMe])
  kernels.py    the update rules (torch's fused CPU Adam/AdamW, SGD)
  aio.py        the swap engine (threaded, O_DIRECT where possible); swapdir.py its files
  tiers.py      device / host / nvme byte accounting for engine.memory_breakdown()
  setup.py      what meshspeed.initialize calls
  auto.py       ZeRO-Infinity's unset buffer settings, chosen (Note [defaults that fit])
  residency.py  how much offloaded state stays in host memory (Note [the residency budget])
  space.py      room on the swap disks for the files the first step writes
See docs/offload.md.
"""

from meshspeed.offload.aio import SwapEngine
from meshspeed.offload.auto import choose_unset_knobs
from meshspeed.offload.optimizer import BackgroundStep, OffloadOptimizer
from meshspeed.offload.placement import OffloadPlacement
from meshspeed.offload.setup import (
    check_host_memory,
    check_offload,
    enable_update_in_backward,
    offload_optimizer,
    offload_placement,
)
from meshspeed.offload.tiers import TIERS, add_tiers, resident_state_tensors

__all__ = [
    "TIERS",
    "BackgroundStep",
    "OffloadOptimizer",
    "OffloadPlacement",
    "SwapEngine",
    "add_tiers",
    "check_host_memory",
    "check_offload",
    "choose_unset_knobs",
    "close",
    "enable_update_in_backward",
    "flush",
    "offload_optimizer",
    "offload_placement",
    "resident_state_tensors",
]


def flush(engine) -> None:
    """With delayed_update: finish the running host step and publish it into the module's
    parameters (call on every rank, e.g. before evaluation). A no-op otherwise."""
    engine.strategy.flush()


def close(engine) -> None:
    """Finish background work and remove this rank's swap files now (they are removed at
    exit or when the engine is garbage collected otherwise)."""
    if isinstance(engine.optimizer, OffloadOptimizer):
        engine.optimizer.close()
    engine.strategy.close()

"""Where a ZeRO unit's tensors live: the placement policy the strategy is handed.

`Zero` calls its placement at fixed points of a step; `DevicePlacement` (everything on
the compute device) is the default, and meshspeed/offload/placement.py's
`OffloadPlacement` keeps masters, their gradients and stage-3 shards in host memory or
swap files. The strategy never asks which one it has.

    unit_built(zero, unit)   one unit is built (before the next): move its masters (update
                             zero.master_of) and its stage-3 shard
    bind(zero)               every unit is built
    grad_shard_ready(unit)   a unit's reduced gradient landed during the boundary backward
    before_step(zero)        prepare_step starts (a delayed update is joined and published)
    attach_grads(units)      masters get their gradients
    deferred_grads()         None, or what stands for gradients kept in files (the engine's
                             boundary runs on it: Note [gradients in their NVMe slot])
    finish_step(zero)        after the optimizer step: publish masters, drop gradients
    wait()                   before anything reads masters or optimizer state
"""

from __future__ import annotations

import torch

from meshspeed.parallel.zero.flat import publish_all


class DevicePlacement:
    """Every tensor of every unit stays where the unit made it."""

    pin = False
    runner = None  # no background optimizer step

    def unit_built(self, zero, unit) -> None:
        pass

    def bind(self, zero) -> None:
        pass

    def grad_shard_ready(self, unit) -> None:
        pass

    def before_step(self, zero) -> None:
        pass

    def deferred_grads(self):
        """Gradients kept outside the masters' .grad (files), or None."""
        return

    def attach_grads(self, units) -> None:
        for unit in units:
            unit.attach_master_grads()

    def finish_step(self, zero) -> None:
        publish_all(zero.units)
        for unit in zero.units:
            unit.drop_grads()

    def wait(self) -> None:
        pass

    def published(self) -> None:
        """Masters were just written into the parameters from outside the step (load)."""

    def flush(self, zero) -> None:
        pass

    def swapped_master(self, master):
        """An object with read() / write(values) when `master` lives in a file, else None."""
        return

    def extra_grads(self) -> list[torch.Tensor]:
        return []

    def param_staging(self) -> list[torch.Tensor]:
        """Host buffers that stage parameter shards to and from files."""
        return []

    def grad_staging(self) -> list[torch.Tensor]:
        """Host buffers kept for staging gradients to files, holding no gradient between uses
        (counted with the communication buffers)."""
        return []

    def host_tensors(self, zero) -> list[torch.Tensor]:
        return []

    def nvme_bytes(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass

"""`apply_compression(model, mesh, config)`: compression training as `meshspeed.initialize`
applies it (Note [one contract for every axis] in meshspeed/parallel/protocol.py).

`init_compression` (compress.py) has already replaced the model's layers; what the engine
needs is the schedule that turns each technique on at its `schedule_offset`, stepped
after every applied optimizer step, as in DeepSpeed (scheduler.py). Tensor parallelism
is refused by the composition table (meshspeed/config/composition.py).
"""

from __future__ import annotations

from torch import nn

from meshspeed.compression.scheduler import compression_scheduler
from meshspeed.config import MeshspeedConfig
from meshspeed.topology import Topology

__all__ = ["apply_compression"]


def apply_compression(model: nn.Module, mesh: Topology, config: MeshspeedConfig) -> compression_scheduler | None:
    """The engine's compression schedule; None when the config asks for no technique."""
    del mesh  # compression composes with every axis the table allows, the same on each rank
    if not config.compression_training.enabled_techniques():
        return None
    return compression_scheduler(model, config.compression_training)

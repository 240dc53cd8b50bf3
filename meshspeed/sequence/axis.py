"""`apply_cp(model, mesh, config)`: context parallelism as `meshspeed.initialize` applies it
(Note [one contract for every axis] in meshspeed/parallel/protocol.py).

The model's attention is routed through a `ContextParallel` over the mesh's cp axis
(models.py), so the model's code does not change, and the engine's forward goes through
`ContextForward.run`, which cuts each batch for this rank and weighs the loss (data.py;
Note [cutting a batch for context parallelism]). A model that calls DeepSpeed's
DistributedAttention itself keeps its own batches, as under DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshspeed.config import MeshspeedConfig
from meshspeed.parallel.protocol import ForwardPart
from meshspeed.sequence.context import ContextParallel
from meshspeed.sequence.data import cut_batch, weigh_loss
from meshspeed.sequence.models import attach
from meshspeed.topology import Topology

__all__ = ["ContextForward", "apply_cp"]


class ContextForward(ForwardPart):
    """The engine's forward under context parallelism."""

    def __init__(self, context: ContextParallel, cuts_batches: bool):
        self.context, self.cuts_batches = context, cuts_batches

    def run(self, module: nn.Module, inputs: tuple, kwargs: dict) -> Any:
        if not self.cuts_batches:
            return module(*inputs, **kwargs)
        inputs, kwargs, weight = cut_batch(self.context, module, inputs, kwargs)
        return weigh_loss(self.context, module(*inputs, **kwargs), weight)


def apply_cp(model: nn.Module, mesh: Topology, config: MeshspeedConfig) -> ContextForward | None:
    """Attach the model's attention to the mesh's cp axis; None at cp 1. Collective over
    the world when the hybrid method's sub-axis groups are made."""
    if mesh.size("cp") == 1:
        return None
    context = ContextParallel(config.sequence, mesh)
    return ContextForward(context, attach(model, context))

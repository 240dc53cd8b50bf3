"""`Composed`: everything `engine/build.py` hands the engine, in one object.

The engine is built from parts that each axis's `apply_<axis>` returned (Note [one
contract for every axis] in meshspeed/parallel/protocol.py); this record keeps the
engine's constructor to one argument and says in one place what an engine is made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshspeed.config import MeshspeedConfig
from meshspeed.parallel.protocol import ForwardPart, StepCallback, StepPart, Strategy
from meshspeed.topology import Topology


@dataclass
class Composed:
    module: nn.Module  # the model, with every axis applied (this rank's stage and shards)
    config: MeshspeedConfig  # parsed once, batch triad derived for the mesh's dp size
    mesh: Topology  # every group of this rank, sub-axis groups included
    strategy: Strategy  # the sharding axis (stage 0 / ZeRO 1-3, offload inside)
    optimizer: torch.optim.Optimizer  # over the strategy's master tensors
    scaler: Any  # fp16 loss scaling (optim/precision.py), a no-op scaler otherwise
    device: torch.device
    lr_scheduler: Any = None
    dataloader: Any = None
    comm_logger: Any = None  # the comms_logger block's CommLogger, when enabled
    forward: ForwardPart | None = None  # context parallelism's batch cut
    step_parts: list[StepPart] = field(default_factory=list)  # tensor / pipeline parallelism
    callbacks: list[StepCallback] = field(default_factory=list)  # compression's schedule

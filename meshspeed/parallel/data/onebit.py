"""`apply_onebit(optimizer, strategy, mesh, config)`: the 1-bit optimizers as an axis
(Note [one contract for every axis] in meshspeed/parallel/protocol.py).

1-bit Adam, 0/1 Adam and 1-bit LAMB communicate by themselves on some steps (Note [1-bit
Adam's two phases] in optim/onebit.py, Note [0/1 Adam's schedule] in optim/zero_one.py):
the strategy then leaves gradients local (Note [gradients left local] in ddp.py), which
the data-parallel strategy declares it can (`LocalGradients`). The layouts where this is
not built (ZeRO 1-3, 16-bit training, other axes) are refused by the composition table,
as DeepSpeed also requires ZeRO stage 0.
"""

from __future__ import annotations

import torch

from meshspeed.config import ConfigError
from meshspeed.optim.onebit import CompressedOptimizer
from meshspeed.parallel.protocol import LocalGradients, Strategy, declares

__all__ = ["apply_onebit"]


def apply_onebit(optimizer: torch.optim.Optimizer, strategy: Strategy) -> None:
    """Hand a 1-bit optimizer's schedule to the strategy; nothing for other optimizers."""
    if not isinstance(optimizer, CompressedOptimizer):
        return
    if not declares(strategy, LocalGradients):  # the table already refuses every such layout
        raise ConfigError([(f"optimizer.type: {type(optimizer).__name__} needs the data-parallel "
                            "strategy (ZeRO stage 0), which leaves gradients local on its compressed steps")])
    strategy.leave_gradients_local(optimizer.gradients_local)

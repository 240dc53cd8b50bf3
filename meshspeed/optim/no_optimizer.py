"""The optimizer of an engine built without one: forward and evaluation, no training step.

Note [an engine without an optimizer]
DeepSpeed's `initialize(model=..., config=...)` with no optimizer (none passed, none in the
config) builds an engine that runs forward, evaluation and, at ZeRO-3, the gathering of
sharded parameters, which is how Hugging Face's Trainer evaluates a ZeRO-3 model before (or
without) training, and how scripts load a checkpoint to run it. meshspeed builds the same
engine: the strategy shards and gathers as usual, and this stands where the optimizer would
be, holding the masters' parameter groups (lr 0) so that everything reading groups works.
Its `step()` is the one thing it refuses, with what to pass instead, on every rank alike
(the config is the same on every rank, so no rank waits for another). `initialize` returns
None in the optimizer's place, as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NoOptimizer", "NoOptimizerError"]


class NoOptimizerError(RuntimeError):
    """A training step was asked of an engine built without an optimizer."""


class NoOptimizer(torch.optim.Optimizer):
    """Stands in for the optimizer of an engine built without one (module docstring)."""

    def __init__(self, groups: list[dict]):
        super().__init__(groups or [{"params": []}], {"lr": 0.0})

    def step(self, closure: Any = None) -> None:
        raise NoOptimizerError(
            "engine.step(): this engine was built without an optimizer (initialize got none and the config "
            "has no \"optimizer\" block), so it can run forward and evaluation only; to train, pass "
            "initialize(optimizer=...) or add e.g. {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}}")

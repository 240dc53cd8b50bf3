"""DeepSpeed's optimizer wrapper classes, as names meshspeed never instantiates.

Note [DeepSpeed's optimizer wrappers]
DeepSpeed's `engine.optimizer` is a wrapper that owns the fp32 masters and the loss
scaling, around the torch optimizer (`engine.optimizer.optimizer`): `FP16_Optimizer`,
`FP16_UnfusedOptimizer`, `DeepSpeedZeroOptimizer` (stages 1-2), `DeepSpeedZeroOptimizer_Stage3`.
meshspeed's engine.optimizer is the torch optimizer itself, stepping the fp32 masters; the
ZeRO strategy and the loss scaler are other parts of the engine. Scripts import the
wrapper classes to ask `isinstance(engine.optimizer, DeepSpeedZeroOptimizer)` and then
read the wrapper's internals (`single_partition_of_fp32_groups`, `fp32_groups_flat`);
under meshspeed the answer is False, and the script's branch for a plain torch optimizer
is the right one: `engine.optimizer.state_dict()` and `param_groups` are the real state.
The classes exist so those imports and checks work; building one is an error that says
what to use instead, never a wrapper that does nothing.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["DeepSpeedOptimizerName"]


class DeepSpeedOptimizerName:
    """Base of DeepSpeed's wrapper class names (Note [DeepSpeed's optimizer wrappers])."""

    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            f"meshspeed has no {type(self).__name__} to build: deepspeed.initialize builds the "
            "engine's optimizer from the config (ZeRO stage, fp16/bf16), and engine.optimizer is the "
            "torch optimizer itself; pass your torch optimizer to deepspeed.initialize(optimizer=...)")

"""`deepspeed.runtime.fp16.unfused_optimizer`: the name `FP16_UnfusedOptimizer`, for
imports and isinstance checks (Note [DeepSpeed's optimizer wrappers] in runtime/wrapper_names.py)."""

from meshspeed.compat.deepspeed.runtime.wrapper_names import DeepSpeedOptimizerName

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer(DeepSpeedOptimizerName):
    """DeepSpeed's fp16 wrapper for LAMB-style optimizers; never an engine.optimizer here."""
